"""plait: braid computation and communication so that neither waits for the other.

Library entry points (the `plait` command line is built on them):

- `plait.data_parallel`: DDP with gradient compression (ACP-SGD, Power-SGD, ...).
- `plait.fuse`: train B models of one architecture as one fused array (`plait.fused`).
- `plait.parallelize`, `plait.Plan`: data, tensor, sequence and pipeline parallelism with
  ZeRO and offload in one plan, or ``plan="auto"`` (`plait.parallel`).
- `plait.cluster`: an emulated multi-node cluster on one machine.
- `plait.comm`: ordered collectives, fusion planners, the alpha-beta cost model.
- `plait.train`, `plait.bench`: the training loop and the benchmark harness.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from plait._lazy import lazy_getattr

if TYPE_CHECKING:
    from plait.dp import data_parallel
    from plait.fused import fuse
    from plait.parallel import Plan, parallelize

try:  # one version: the installed distribution's metadata, set in pyproject.toml
    __version__ = _metadata.version("plait")
except _metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["Plan", "__version__", "data_parallel", "fuse", "parallelize"]

#: Entry points, imported on first use: ``import plait`` itself loads no torch (the command
#: line's ``--help`` stays fast), and `fuse` alone pulls in torch.library's fake tensors
#: and with them torch._dynamo (1.2 s of the 2.4 s ``import plait`` took when eager).
_LAZY = {
    "data_parallel": "plait.dp",
    "fuse": "plait.fused",
    "Plan": "plait.parallel",
    "parallelize": "plait.parallel",
}


_entry_point = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _entry_point(name)
    if not name.startswith("_") and importlib.util.find_spec(f"plait.{name}") is not None:
        # every module is an attribute (``plait.crossover.attach`` after ``import plait``)
        return importlib.import_module(f"plait.{name}")
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
