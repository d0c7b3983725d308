"""Throughput benchmark of fused arrays against serial, concurrent and vmap training."""

from __future__ import annotations

from plait.bench.fused.models import MODEL_ALIASES, BenchModel, get_model
from plait.bench.fused.runner import BenchConfig, run_bench_fused
from plait.bench.fused.strategies import ArrayStrategy, StockAdam

__all__ = [
    "MODEL_ALIASES",
    "ArrayStrategy",
    "BenchConfig",
    "BenchModel",
    "StockAdam",
    "get_model",
    "run_bench_fused",
]
