"""Benchmarks: one harness core (interleaved rounds, medians, CPU accounting, records) and
the suites built on it; results land in `benchmarks/` with their provenance."""
