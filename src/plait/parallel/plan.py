"""`Plan`: how one model is spread over the world, in one immutable value.

A plan names a degree per axis (pipeline x data x tensor = world size), the ZeRO stage of
the data axis, sequence parallelism, the pipeline schedule, CPU offload, activation
checkpointing and the gradient compressor of the data axis. It is checked against the
world size and the model's shape (`Plan.validate`) before any process group exists, so a
wrong plan fails with a message instead of a hang or a shape error deep in a collective.

Plans read and print as ``key=value`` lists (``"dp=2,tp=2,zero=3,sp=true"``), the same
syntax as strategy options.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.parallel.adapters import ModelDims


class ZeroStage(IntEnum):
    """What the data axis shards (ZeRO stages 1-3; 0 replicates everything)."""

    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


class Schedule(StrEnum):
    """Pipeline schedules of `torch.distributed.pipelining`.

    `interleaved` and `zero-bubble` hold two stages per rank (looped and V-shaped).
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zero-bubble"

    @property
    def stages_per_rank(self) -> int:
        return 2 if self in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE) else 1


#: Data-axis compressors that exist as DDP comm hooks (see `plait.dp`).
DEFAULT_COMPRESSION = "ssgd"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One way to parallelise a model.

    Attributes:
        dp: data-parallel degree; None takes what the other axes leave of the world.
        tp: tensor-parallel degree (Megatron-style column/row sharding of each block).
        pp: pipeline-parallel degree (stages on distinct ranks).
        zero: ZeRO stage of the data axis: 1 shards optimizer states
            (ZeroRedundancyOptimizer), 2 also gradients, 3 also parameters (FSDP2).
        sp: sequence parallelism inside tensor-parallel regions (norms and residuals
            sharded along the sequence); needs tp > 1.
        schedule: pipeline schedule (used when pp > 1).
        microbatches: micro-batches per step through the pipeline (default: 2 * pp).
        offload: keep sharded parameters, gradients and optimizer states in host memory
            (FSDP2 CPUOffloadPolicy); needs zero >= 2.
        ac: activation checkpointing of every block (recompute in backward).
        compression: gradient compressor of the data axis (a DDP comm hook, so zero <= 1,
            tp = 1 and pp = 1).
    """

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    zero: ZeroStage = ZeroStage.NONE
    sp: bool = False
    schedule: Schedule = Schedule.ONE_F_ONE_B
    microbatches: int | None = None
    offload: bool = False
    ac: bool = False
    compression: str = DEFAULT_COMPRESSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "zero", _enum(ZeroStage, self.zero, "zero"))
        object.__setattr__(self, "schedule", _enum(Schedule, self.schedule, "schedule"))
        for key in ("dp", "microbatches"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"plan: {key} must be >= 1, got {value}")
        for key in ("tp", "pp"):
            if getattr(self, key) < 1:
                raise ValueError(f"plan: {key} must be >= 1, got {getattr(self, key)}")
        if self.sp and self.tp == 1:
            raise ValueError("plan: sequence parallelism (sp) needs tp > 1")
        if self.zero is ZeroStage.OPTIMIZER and self.tp > 1:
            raise ValueError(
                "plan: zero=1 (ZeroRedundancyOptimizer) works on plain tensors only, so it "
                "needs tp=1; use zero=2 with tensor parallelism"
            )
        if self.offload and self.zero < ZeroStage.GRADIENTS:
            raise ValueError("plan: offload (FSDP2 CPUOffloadPolicy) needs zero=2 or zero=3")
        from plait.dp.compress import compressor_class

        compressor_class(self.compression)  # unknown names fail here
        if self.compression != DEFAULT_COMPRESSION and (
            self.zero > ZeroStage.OPTIMIZER or self.tp > 1 or self.pp > 1
        ):
            raise ValueError(
                f"plan: compression {self.compression!r} is a DDP comm hook on the data axis; "
                "it needs zero <= 1, tp = 1 and pp = 1"
            )
        if (
            self.pp > 1
            and self.schedule is Schedule.ZERO_BUBBLE
            and self.zero is ZeroStage.PARAMETERS
        ):
            # measured: the split weight-gradient pass runs after FSDP2 has resharded and
            # reduced the stage, so gradients come out wrong
            raise ValueError("plan: the zero-bubble schedule does not compose with zero=3")
        if self.pp > 1 and self.schedule is Schedule.ZERO_BUBBLE and self.sp:
            # measured: the split input-gradient pass detaches the stage input in place,
            # which sequence parallelism's sharded view of it does not allow
            raise ValueError("plan: the zero-bubble schedule does not compose with sp")
        if self.pp > 1 and self.schedule is Schedule.ZERO_BUBBLE and self.ac:
            # measured on the GPT (dp=2,pp=2, 2 micro-batches): 150 MiB per rank with
            # checkpointing, 111 MiB without (likely: the split backward keeps what the
            # input pass recomputed until the weight pass); it adds compute and memory
            raise ValueError(
                "plan: activation checkpointing under the zero-bubble schedule holds more "
                "memory than without it; use ac=false, or schedule=1f1b with ac=true"
            )
        if self.microbatches is not None and self.pp == 1 and self.microbatches != 1:
            raise ValueError("plan: microbatches applies to pipelines (pp > 1)")

    # ----------------------------------------------------------------- sizes
    def data_degree(self, world: int) -> int:
        """`dp`, or the world divided by the other axes when `dp` is None."""
        if self.dp is not None:
            return self.dp
        return max(1, world // (self.tp * self.pp))

    @property
    def single_process(self) -> bool:
        """Whether the plan runs without any process group (nothing distributed)."""
        return self.dp in (None, 1) and self.tp == self.pp == 1 and self.zero is ZeroStage.NONE

    def n_microbatches(self) -> int:
        if self.pp == 1:
            return 1
        return self.microbatches if self.microbatches is not None else 2 * self.pp

    def n_stages(self) -> int:
        return self.pp * self.schedule.stages_per_rank if self.pp > 1 else 1

    def resolved(self, world: int) -> Plan:
        """This plan with `dp` and `microbatches` filled in."""
        return dataclasses.replace(
            self,
            dp=self.data_degree(world),
            microbatches=self.n_microbatches() if self.pp > 1 else None,
        )

    # ------------------------------------------------------------- validation
    def validate(self, *, world: int, dims: ModelDims | None = None) -> Plan:
        """Check the plan against the world size and the model; return it resolved.

        Raises:
            ValueError: degrees whose product is not `world`, a tensor degree that does not
                divide the heads or widths, more pipeline stages than layers, too few
                micro-batches for the schedule.
        """
        dp = self.data_degree(world)
        if dp * self.tp * self.pp != world:
            raise ValueError(
                f"plan: dp={dp} x tp={self.tp} x pp={self.pp} = {dp * self.tp * self.pp} "
                f"is not the world size {world}"
            )
        if self.pp > 1 and self.n_microbatches() < self.pp:
            raise ValueError(
                f"plan: {self.n_microbatches()} micro-batches cannot fill {self.pp} pipeline "
                f"stages; use microbatches >= {self.pp}"
            )
        if dims is not None:
            dims.check_tensor_degree(self.tp, sequence=self.sp)
            if self.pp > 1 and self.n_stages() > dims.layers:
                model = f"the model {dims.model}" if dims.model else "the model"
                why = (
                    " (no stack of repeated blocks plait can split: register a ModelAdapter "
                    "for it, plait.parallel.register_adapter)"
                    if dims.layers == 0
                    else ""
                )
                raise ValueError(
                    f"plan: {self.n_stages()} pipeline stages ({self.pp} ranks x "
                    f"{self.schedule.stages_per_rank} for {self.schedule.value}) need at least "
                    f"as many blocks, {model} has {dims.layers}{why}"
                )
        return self.resolved(world)

    # --------------------------------------------------------------- text form
    @classmethod
    def parse(cls, text: str) -> Plan:
        """A plan from ``"dp=2,tp=2,zero=3"`` (keys are the field names).

        Raises:
            ValueError: unknown keys or values.
        """
        from plait.specs import parse_spec

        _, options = parse_spec(":" + text)
        return cls.from_options(options)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Plan:
        names = {f.name for f in dataclasses.fields(cls)}
        for key in options:
            if key not in names:
                raise ValueError(
                    f"plan: unknown key {key!r} (accepted: {', '.join(sorted(names))})"
                )
        values = dict(options)
        for key in ("schedule", "compression"):
            if key in values:
                values[key] = str(values[key])
        for key in ("sp", "offload", "ac"):
            if key in values and not isinstance(values[key], bool):
                raise ValueError(f"plan: {key} must be true or false, got {values[key]!r}")
        for key in ("dp", "tp", "pp", "zero", "microbatches"):
            if key in values and (
                isinstance(values[key], bool) or not isinstance(values[key], int)
            ):
                raise ValueError(f"plan: {key} must be an integer, got {values[key]!r}")
        return cls(**values)

    def describe(self) -> str:
        """The shortest ``key=value`` text that parses back to this plan."""
        default = Plan()
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == getattr(default, f.name) and f.name != "dp":
                continue
            if f.name == "dp" and value is None:
                continue
            if f.name == "schedule" and self.pp == 1:
                continue
            if isinstance(value, bool):
                value = str(value).lower()
            elif isinstance(value, (ZeroStage,)):
                value = int(value)
            elif isinstance(value, Schedule):
                value = value.value
            parts.append(f"{f.name}={value}")
        return ",".join(parts) or "dp=auto"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["zero"] = int(self.zero)
        out["schedule"] = self.schedule.value
        return out


def _enum(cls: Any, value: Any, key: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in cls)
        raise ValueError(f"plan: invalid {key} {value!r}; choose from {choices}") from None
