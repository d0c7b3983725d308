"""The result records of the benchmark suites, typed.

Each is a `plait.records.Record`: the fields, in order, are the keys of the JSON record
the suite has always written (DESIGN.md's command-line contract names the required keys
of ``plait bench``'s), so scripts that read ``results.json`` see no change. Fields that
older files lack have None defaults and load from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Self

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


@dataclass(kw_only=True)
class ModeResult:
    """One way of co-locating the jobs, medians over the repeats."""

    steps_per_s: list[float]  # each job's rate inside the common window
    normalised: list[float]  # each job's rate over its rate alone
    speedup_vs_sequential: float  # the sum of the normalised rates
    speedup_runs: list[float]  # that sum in every repeat
    slowdown_vs_alone: list[float]
    window_s: float
    token: list[dict[str, float] | None]  # each job's token statistics (last repeat)
    fairness: float  # Jain's index of the normalised rates
    cpu_busy: float | None = None  # host CPU busy share inside the window

    def to_dict(self) -> dict[str, Any]:
        """The mode's JSON object."""
        return asdict(self)


@dataclass(kw_only=True)
class Comparison(Record):
    """Sequential vs uncoordinated vs crossover for one set of jobs at one network setting."""

    jobs: list[str]
    bandwidth: str
    rate: str
    steps: int
    warmup: int
    repeats: int
    alone_steps_per_s: list[float]
    alone_step_s: list[float]
    compute_s: list[float]
    co_located_steps: list[int] = field(default_factory=list)
    alone_cpu_busy: list[float | None] | None = None
    modes: dict[str, ModeResult] = field(default_factory=dict)

    derived: ClassVar[tuple[str, ...]] = ("ideal_speedup",)

    def ideal_speedup(self) -> float:
        """Normalised throughput of a perfect crossover, from the jobs' measured compute c
        (token hold time alone) and communication m (the rest of a step alone).

        Jobs take turns: while job i computes, job i-1 communicates, so a cycle in which
        every job does one step lasts sum_i max(c_i, m_(i-1)); for two jobs that is the
        ideal max(cA, mB) + max(cB, mA) against cA + mA + cB + mB one after another.
        """
        c = self.compute_s
        m = [max(0.0, s - ci) for s, ci in zip(self.alone_step_s, c, strict=True)]
        cycle = sum(max(c[i], m[i - 1]) for i in range(len(c)))
        return sum((ci + mi) / cycle for ci, mi in zip(c, m, strict=True))

    def extra_keys(self) -> dict[str, Any]:
        """The ideal speed-up, written beside the measured ones."""
        return {"ideal_speedup": self.ideal_speedup()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """A comparison from its JSON object (its modes included)."""
        modes = {k: ModeResult(**v) for k, v in data.get("modes", {}).items()}
        return super().from_dict({**data, "modes": modes})
