"""`KFACConfig`: K-FAC's hyper-parameters and the switches of its distributed mechanics.

Every value is checked when the config is built, so bad input fails at once with a message
naming the problem; a hyper-parameter given as a callable of the step is checked each time
it is evaluated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from plait.kfac.factors import InverseForm, Method
from plait.kfac.intervals import AUTO
from plait.kfac.layers import Approximation
from plait.kfac.pipeline import FactorComm, FactorSync
from plait.kfac.placement import Distribution, PlacementPolicy

ScheduledValue = float | Callable[[int], float]
IntSchedule = int | Callable[[int], int]
#: An interval: a constant, a callable of the step, or ``"auto"`` (`plait.kfac.intervals`).
Interval = IntSchedule | str

_DTYPES = {"fp32": None, "float32": None, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}  # fmt: skip


def _enum(cls: Any, value: Any, what: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise ValueError(f"unknown {what} {value!r}; choose from {choices}") from None


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """K-FAC hyper-parameters and the distributed mechanics.

    Attributes:
        damping: Tikhonov damping gamma (> 0).
        factor_decay: running-average weight of the old factors, in [0, 1).
        kl_clip: bound on the step's KL change, ``lr^2 <P, M>`` (None: no clipping).
        lr: learning rate used by KL clipping (None: the attached optimizer's).
        factor_interval: steps between factor updates (>= 1), or ``"auto"``.
        inv_interval: steps between inversions (>= 1), or ``"auto"``: chosen from the
            measured base step, factor update and inversion round, as the smallest
            intervals whose amortised overhead stays within `auto_overhead` of the base
            step (`plait.kfac.intervals`), the same on every rank, and decided again when
            a measured cost drifts.
        auto_overhead: ``"auto"`` intervals: the overhead budget, a fraction of the base
            step (> 0).
        auto_max_interval: ``"auto"`` intervals: the largest interval chosen (>= 1).
        auto_drift: ``"auto"`` intervals: decide again when a windowed median cost
            moves by more than this factor from the one decided on (> 1).
        auto_window: ``"auto"`` intervals: steps per drift check (>= 1).
        approximation: ``expand`` (every position of a convolution or of a sequence is a
            factor row; KFC) or ``reduce`` (one row per sample: its mean input and summed
            output gradient; far cheaper on convolutions), `plait.kfac.layers`.
        method: ``inverse`` (Cholesky) or ``eigen``.
        inverse_form: how the inverse method holds a factor: ``cholesky`` (triangular
            factor, solves), ``explicit`` (inverse, products) or ``auto`` (per factor, from
            how often it is used before the next inversion).
        comm: factor communication: ``after-backward``, ``static`` or ``dynamic``.
        sync: ``eager`` (batch factors every update) or ``lazy`` (running averages, only
            when inverting; the same factors, fewer bytes).
        packed: symmetric factors are computed and travel as upper triangles, and so do
            the inverse method's results.
        comm_dtype: factor wire dtype, None/"fp32", "fp16" or "bf16".
        bucket_cap_mb: static bucket threshold (MB).
        placement: ``round-robin``, ``greedy`` or ``lpt``.
        local_inversion: invert factors on every worker when cheaper than broadcasting.
        overlap: invert each factor as soon as its bucket arrives (else after all arrive).
        distribution: ``comm-opt``, ``mem-opt``, ``hybrid`` or ``auto`` (the cheapest per
            step under the alpha-beta and compute models).
        grad_workers: hybrid: workers per gradient-worker block (must divide the world).
        skip_layers: glob patterns of module names or class names to leave alone.
        probe: measure the alpha-beta model at start-up (else assume 1 Gbit/s).
        replan_every: communicating steps between drift checks of the dynamic fusion plan.
    """

    damping: ScheduledValue = 1e-3
    factor_decay: ScheduledValue = 0.95
    kl_clip: ScheduledValue | None = 1e-3
    lr: ScheduledValue | None = None
    factor_interval: Interval = 1
    inv_interval: Interval = 1
    approximation: Approximation | str = Approximation.EXPAND
    method: Method | str = Method.INVERSE
    inverse_form: InverseForm | str = InverseForm.AUTO
    comm: FactorComm | str = FactorComm.DYNAMIC
    sync: FactorSync | str = FactorSync.EAGER
    packed: bool = True
    comm_dtype: torch.dtype | str | None = None
    bucket_cap_mb: float = 25.0
    placement: PlacementPolicy | str = PlacementPolicy.LPT
    local_inversion: bool = True
    overlap: bool = True
    distribution: Distribution | str = Distribution.COMM_OPT
    grad_workers: int | None = None
    skip_layers: tuple[str, ...] = ()
    probe: bool = True
    replan_every: int = 10
    auto_overhead: float = 0.25
    auto_max_interval: int = 100
    auto_drift: float = 2.0
    auto_window: int = 20

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("approximation", _enum(Approximation, self.approximation, "approximation"))
        set_("method", _enum(Method, self.method, "method"))
        set_("inverse_form", _enum(InverseForm, self.inverse_form, "inverse_form"))
        set_("comm", _enum(FactorComm, self.comm, "factor communication"))
        set_("sync", _enum(FactorSync, self.sync, "factor sync"))
        set_("placement", _enum(PlacementPolicy, self.placement, "placement"))
        set_("distribution", _enum(Distribution, self.distribution, "distribution"))
        if isinstance(self.comm_dtype, str):
            if self.comm_dtype.lower() not in _DTYPES:
                raise ValueError(f"unknown comm_dtype {self.comm_dtype!r}; choose fp32, fp16, bf16")
            set_("comm_dtype", _DTYPES[self.comm_dtype.lower()])
        set_("skip_layers", tuple(self.skip_layers))
        check_float("damping", self.damping, low=0.0, low_open=True)
        check_float("factor_decay", self.factor_decay, low=0.0, high=1.0)
        if self.kl_clip is not None:
            check_float("kl_clip", self.kl_clip, low=0.0, low_open=True)
        if self.lr is not None:
            check_float("lr", self.lr, low=0.0)
        for name in ("factor_interval", "inv_interval"):
            value = getattr(self, name)
            if isinstance(value, str) and value.lower() == AUTO:
                set_(name, AUTO)
            else:
                check_int(name, value)
        if self.auto_intervals and not (
            isinstance(self.factor_interval, int | str) and isinstance(self.inv_interval, int | str)
        ):
            raise ValueError('"auto" intervals cannot be combined with a schedule callable')
        if not self.auto_overhead > 0:
            raise ValueError(f"auto_overhead must be > 0, got {self.auto_overhead}")
        check_int("auto_max_interval", self.auto_max_interval)
        if not self.auto_drift > 1:
            raise ValueError(f"auto_drift must be > 1, got {self.auto_drift}")
        check_int("auto_window", self.auto_window)
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.grad_workers is not None and self.grad_workers < 1:
            raise ValueError(f"grad_workers must be >= 1, got {self.grad_workers}")
        if self.replan_every < 1:
            raise ValueError(f"replan_every must be >= 1, got {self.replan_every}")

    @property
    def auto_intervals(self) -> bool:
        """Whether either interval is chosen by `plait.kfac.intervals`."""
        return AUTO in (self.factor_interval, self.inv_interval)

    def constants(self) -> dict[str, Any]:
        """The plain-valued settings (for reports and checkpoints)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if callable(v) and not isinstance(v, type):
                continue
            out[f.name] = str(v) if isinstance(v, torch.dtype) else v
        return out


def check_float(
    name: str, value: Any, *, low: float, high: float | None = None, low_open: bool = False
) -> None:
    if callable(value):
        return
    v = float(value)
    bad = v < low or (low_open and v <= low) or (high is not None and v >= high)
    if bad:
        rng = f"{'>' if low_open else '>='} {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"{name} must be {rng}, got {value}")


def check_int(name: str, value: Any) -> None:
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_value(name: str, schedule: Any, step: int, **check: Any) -> Any:
    """A hyper-parameter at `step`, validated when it comes from a callable."""
    if not callable(schedule):
        return schedule
    v = schedule(step)
    if name.endswith("interval"):
        check_int(name, v)
    else:
        check_float(name, v, **check)
    return v
