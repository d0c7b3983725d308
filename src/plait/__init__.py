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

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from plait.dp import data_parallel
from plait.fused import fuse

if TYPE_CHECKING:
    from plait.parallel import Plan, parallelize

try:  # one version: the installed distribution's metadata, set in pyproject.toml
    __version__ = _metadata.version("plait")
except _metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["Plan", "__version__", "data_parallel", "fuse", "parallelize"]


def __getattr__(name: str) -> Any:
    # plait.parallel imports DTensor, FSDP and pipelining: only when first used
    if name in ("Plan", "parallelize"):
        import plait.parallel

        return getattr(plait.parallel, name)
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
