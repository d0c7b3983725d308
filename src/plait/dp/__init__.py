"""Communication-efficient data parallelism: DDP with compressors as comm hooks, and
local-update training (DiLoCo) for links too slow for per-step communication."""

from __future__ import annotations

from plait.dp.api import CommHook, comm_hook, compressor_of, data_parallel, make_compressor
from plait.dp.compress import Compressor, compressor_class, compressor_names
from plait.dp.local import LocalConfig, LocalUpdate, local_update

__all__ = [
    "CommHook",
    "Compressor",
    "LocalConfig",
    "LocalUpdate",
    "comm_hook",
    "compressor_class",
    "compressor_names",
    "compressor_of",
    "data_parallel",
    "local_update",
    "make_compressor",
]
