"""The result records of the benchmark suites, typed.

Each is a `plait.records.Record`: the fields, in order, are the keys of the JSON record
the suite has always written (DESIGN.md's command-line contract names the required keys
of ``plait bench``'s), so scripts that read ``results.json`` see no change. Fields that
older files lack have None defaults and load from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plait.records import ABSENT_IF_NONE, Record


@dataclass(kw_only=True)
class BenchRecord(Record):
    """One strategy of one data-parallel/K-FAC/plan benchmark job (``plait bench``).

    Times are seconds per step, each step's the slowest rank's; the per-round lists keep
    every kept round so ratios can be judged against their spread.
    """

    workload: str
    strategy: str  # the name of the strategy spec ("acpsgd" of "acpsgd:rank=4")
    strategy_spec: str
    strategy_desc: str
    nodes: int
    nproc_per_node: int
    world_size: int
    bandwidth: str
    rate: str
    batch_size: int
    params: int
    steps: int
    warmup: int
    iter_time_s: float  # median over the kept rounds
    iter_time_min_s: float
    iter_time_max_s: float
    iter_time_mean_s: float | None = None
    iter_times_s: list[float]
    compute_time_s: float  # median of the compute-only step (no communication)
    compute_times_s: list[float]
    comm_lower_bound_s: float  # the step's collectives under the probed alpha-beta model
    overlap_efficiency: float  # max(compute, comm lower bound) / iteration
    cpu_time_s: float | None = None  # process CPU per step, mean over ranks, median
    compute_cpu_time_s: float | None = None
    payload_bytes_per_step: float
    bytes_per_step: float  # modelled ring traffic a worker sends
    nic_bytes_per_step: float | None  # counted on the node's link (emulated cluster only)
    samples_per_s: float
    threads: int
    probe: dict[str, Any] | None = field(default=None, metadata=ABSENT_IF_NONE)
    latency: str | None = None
    loss: float | None = None


@dataclass(kw_only=True)
class FusedRecord(Record):
    """One (model, N, strategy, thread count) of the fused-array benchmark."""

    workload: str
    model: str
    strategy: str
    n: int
    bandwidth: str  # "n{N}": the axis reports group by, as ``plait bench`` groups rates
    batch_size: int
    params: int
    threads: int
    device: str
    fastest_threads: bool | None = None  # this strategy's fastest thread count
    iter_time_s: float  # median step (all N models) over rounds
    iter_time_min_s: float
    iter_time_max_s: float
    throughput: float  # samples/s, wall clock
    cpu_time_s: float
    cpu_throughput: float  # samples per CPU second
    speedup_vs_serial: float | None  # at the same thread count
    speedup_vs_fastest_serial: float | None = None
    steps: int
    rounds: int
    malloc_tuned: bool
    stock_adam: str | None = None
    native_kernels: bool | None = None
