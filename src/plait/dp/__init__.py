"""Communication-efficient data parallelism: DDP with compressors as comm hooks."""

from __future__ import annotations

from plait.dp.api import CommHook, comm_hook, compressor_of, data_parallel, make_compressor
from plait.dp.compress import Compressor, compressor_class, compressor_names

__all__ = [
    "CommHook",
    "Compressor",
    "comm_hook",
    "compressor_class",
    "compressor_names",
    "compressor_of",
    "data_parallel",
    "make_compressor",
]
