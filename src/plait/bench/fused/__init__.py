"""Throughput benchmark of fused arrays against serial, concurrent and vmap training."""

from __future__ import annotations

from plait.bench.fused.models import BENCH_MODELS, BenchModel
from plait.bench.fused.runner import BenchConfig, run_bench_fused
from plait.bench.fused.strategies import StockAdam, Strategy

__all__ = ["BENCH_MODELS", "BenchConfig", "BenchModel", "StockAdam", "Strategy", "run_bench_fused"]
