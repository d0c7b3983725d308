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

from plait.records import ABSENT_IF_NONE, PROVENANCE, Record


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
    link: str | None = field(default=None, metadata=ABSENT_IF_NONE)  # tc, model or none
    device: str | None = field(default=None, metadata=ABSENT_IF_NONE)  # rank 0's


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
    conv_layout: str | None = None  # fused 2-d convolutions: "nchw" or "channels_last"


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


@dataclass(kw_only=True)
class FidelityRecord(Record):
    """One (workload, strategy) trained to the end by the fidelity suite: its final test
    metrics and the per-epoch history ``plait train`` wrote."""

    workload: str
    strategy: str
    epochs: int
    nodes: int
    data: str
    steps: int
    batch_size: int
    test_loss: float | None
    test_accuracy: float | None
    history: list[dict[str, Any]]


@dataclass(kw_only=True)
class ConvergenceRun(Record):
    """One training run of the convergence comparison and its evaluation curve."""

    strategy: str
    lr: float
    seed: int
    steps_to_target: int | None  # the first evaluated step at the target (None: never)
    curve: list[dict[str, Any]]


@dataclass(kw_only=True)
class ConvergenceSetting(Record):
    """One (strategy, learning rate): steps to the target per seed and their median (None
    when any seed missed it, so a setting that sometimes fails never wins)."""

    strategy: str
    lr: float
    steps_to_target: list[int | None]
    median: float | None

    @property
    def family(self) -> str:
        """The strategy's name without its options ("spd-kfac" of "spd-kfac:damping=0.1")."""
        return self.strategy.partition(":")[0]


@dataclass(kw_only=True)
class ConvergenceSummary(Record):
    """Every setting, and per strategy family the setting that reached the target first."""

    target: float
    settings: list[ConvergenceSetting]
    best: dict[str, ConvergenceSetting]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """A summary from its JSON object (settings included)."""
        return super().from_dict(
            {
                **data,
                "settings": [ConvergenceSetting.from_dict(s) for s in data.get("settings", [])],
                "best": {
                    k: ConvergenceSetting.from_dict(v) for k, v in data.get("best", {}).items()
                },
            }
        )


@dataclass(kw_only=True)
class RunMeta(Record):
    """What a suite's runs share (the workload, a batch size) and their provenance."""

    workload: str
    batch_size: int | None = field(default=None, metadata=ABSENT_IF_NONE)


@dataclass(kw_only=True)
class ConvergenceReport(Record):
    """The convergence suite's ``results.json``: meta, summary and every run."""

    meta: RunMeta
    summary: ConvergenceSummary
    runs: list[ConvergenceRun]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """A report from its JSON object (its parts included)."""
        return super().from_dict(
            {
                **data,
                "meta": RunMeta.from_dict(data["meta"]),
                "summary": ConvergenceSummary.from_dict(data["summary"]),
                "runs": [ConvergenceRun.from_dict(r) for r in data.get("runs", [])],
            }
        )


@dataclass(kw_only=True)
class KernelRecord(Record):
    """Seconds of each K-FAC kernel pair (textbook, plait) on one layer, medians."""

    layer: str
    rows: int
    a_dim: int
    g_dim: int
    groups: int
    factor_dense_s: float
    factor_tiled_s: float
    decompose_inverse_s: float
    decompose_cholesky_s: float
    precondition_inverse_s: float
    precondition_solves_s: float


@dataclass(kw_only=True)
class KernelReport(Record):
    """The kernel suite's ``results.json``: meta and one record per layer."""

    meta: RunMeta
    layers: list[KernelRecord]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """A report from its JSON object (its layers included)."""
        return super().from_dict(
            {
                **data,
                "meta": RunMeta.from_dict(data["meta"]),
                "layers": [KernelRecord.from_dict(r) for r in data.get("layers", [])],
            }
        )


@dataclass(kw_only=True)
class MemoryRecord(Record):
    """Per-rank memory of one plan (``memory.json``), measured and predicted, in bytes."""

    workload: str
    plan: str
    world: int
    global_batch: int
    model_state_bytes: list[int]  # per rank
    peak_bytes: list[int]  # per rank
    predicted_model_state_bytes: float
    predicted_peak_bytes: float
    unsharded_model_state_bytes: int
    model_state_fraction: float  # the largest rank's model state over the unsharded one


@dataclass(kw_only=True)
class ScoreRow(Record):
    """The planner's choice at one (workload, network, memory budget) setting against the
    measured-fastest plan that fits (``scorecard.json``)."""

    workload: str
    bandwidth: str
    memory_budget: int | None
    chosen: str
    chosen_iter_s: float
    chosen_pooled_iter_s: float  # median over every step measured of the chosen plan
    fastest_fitting: str
    fastest_iter_s: float
    auto_ratio: float
    ratio: float
    is_fastest: bool
    within_tolerance: bool
    chosen_peak_bytes: int | None
    fits_measured: bool | None
    candidates_fitting: int
    candidates: int


@dataclass(kw_only=True)
class TimelineRow(Record):
    """Where one (strategy, phase)'s step goes: seconds per step, the step's wall time and
    each category's busy time (the union of its spans), means over ranks and steps.

    The JSON object is flat, ``{"strategy", "phase", "step", <category>: s, ...}``, the
    categories named as the report's columns ("forward+backward", "gradient comm", ...).
    """

    strategy: str
    phase: str
    step: float
    busy: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The row as its flat JSON object."""
        out = super().to_dict()
        return {**{k: v for k, v in out.items() if k != "busy"}, **self.busy}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """A row from its flat JSON object: keys other than the fields are categories."""
        own = {"strategy", "phase", "step", *PROVENANCE}
        return super().from_dict(
            {
                **{k: v for k, v in data.items() if k in own},
                "busy": {k: v for k, v in data.items() if k not in own},
            }
        )
