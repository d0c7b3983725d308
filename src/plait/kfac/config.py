"""`KFACConfig`: K-FAC's hyper-parameters and the switches of its distributed mechanics.

Every value is checked when the config is built, so bad input fails at once with a message
naming the problem; a hyper-parameter given as a callable of the step is checked each time
it is evaluated. Choice fields hold their enums (a name is accepted and converted).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from plait.kfac.checks import check_float, check_int
from plait.kfac.costs import KFACCosts
from plait.kfac.eigenbasis import Graft, Mode
from plait.kfac.factors import InverseForm, Method
from plait.kfac.intervals import (
    AUTO,
    AutoIntervals,
    FixedIntervals,
    IntervalController,
    IntSchedule,
)
from plait.kfac.layers import Approximation
from plait.kfac.pipeline import FactorComm, FactorSync
from plait.kfac.placement import Distribution, PlacementPolicy, PlacementProvider

ScheduledValue = float | Callable[[int], float]
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


#: The intervals of each mode when none are given: (factor, inversion). K-FAC inverts every
#: step (its step follows the inverses closely); the eigenbasis modes refresh the basis
#: every 10 steps, SOAP's published frequency, since their diagonal (EKFAC's moments,
#: SOAP's Adam) adapts between refreshes. SOAP's factors are updated every 5th step: its
#: Adam adapts every step, so fresher factors only serve the next basis. Measured at
#: `fast` (benchmarks/RESULTS.md, "Second-order"): on the digits CNN, five seeds, the
#: time to 97% fell to 0.70x [0.64-0.90] of updating them every step (the same steps,
#: 21.0 against 26.1 ms a step; AdamW 15.9 ms); on the GPT the same 25 steps to the
#: target with a 7% cheaper step (1.30 against 1.40 s; AdamW 1.10 s).
DEFAULT_INTERVALS: dict[Mode, tuple[int, int]] = {
    Mode.KFAC: (1, 1),
    Mode.EKFAC: (1, 10),
    Mode.SOAP: (5, 10),
}


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """K-FAC hyper-parameters and the distributed mechanics.

    Attributes:
        mode: what the decomposed factors do to a layer's gradient (`plait.kfac.eigenbasis`):
            ``kfac`` (their damped inverse), ``ekfac`` (their eigenbasis, with a diagonal
            re-estimated from the projected gradients) or ``soap`` (Adam in their
            eigenbasis; apply its step with SGD without momentum).
        damping: Tikhonov damping gamma (> 0); ``soap`` does not use it.
        factor_decay: running-average weight of the old factors, in [0, 1).
        kl_clip: bound on the step's KL change, ``lr^2 <P, M>`` (None: no clipping); the
            natural-gradient modes without grafting only.
        lr: learning rate used by KL clipping (None: the attached optimizer's).
        factor_interval: steps between factor updates (>= 1), or ``"auto"``; None: the
            mode's default (`DEFAULT_INTERVALS`).
        inv_interval: steps between inversions (decompositions, basis refreshes), >= 1, or
            ``"auto"``: chosen from the measured costs and, when the loss is given to
            `KFAC.step`, from the loss progress per step at probed intervals
            (`plait.kfac.intervals`), the same on every rank, per phase of training.
            None: the mode's default.
        auto_overhead: ``"auto"`` intervals: the overhead budget, a fraction of the base
            step (> 0), which decides when progress is not measured.
        auto_max_interval: ``"auto"`` intervals: the largest interval chosen (>= 1).
        auto_drift: ``"auto"`` intervals: decide again when a windowed median cost
            moves by more than this factor from the one decided on (> 1).
        auto_window: ``"auto"`` intervals: steps per drift check (>= 1).
        approximation: ``expand`` (every position of a convolution or of a sequence is a
            factor row; KFC) or ``reduce`` (one row per sample: its mean input and summed
            output gradient; far cheaper on convolutions), `plait.kfac.layers`.
        method: ``inverse`` (Cholesky) or ``eigen``; None: ``eigen`` for the eigenbasis
            modes (which need it), ``inverse`` for ``kfac``.
        inverse_form: how the inverse method holds a factor: ``cholesky`` (triangular
            factor, solves), ``explicit`` (inverse, products) or ``auto`` (per factor, from
            how often it is used before the next inversion).
        comm: factor communication: ``after-backward``, ``static`` or ``dynamic``.
        sync: ``eager`` (batch factors every update) or ``lazy`` (running averages, only
            when inverting; the same factors, fewer bytes).
        packed: symmetric factors are computed and travel as upper triangles, and so do
            the inverse method's results.
        comm_dtype: factor wire dtype, None (``"fp32"``), float16 or bfloat16 (``"fp16"``,
            ``"bf16"``).
        bucket_cap_mb: static bucket threshold (MB).
        placement: ``round-robin``, ``greedy`` or ``lpt``.
        local_inversion: invert factors on every worker when cheaper than broadcasting.
        overlap: invert each factor as soon as its bucket arrives (else after all arrive).
        distribution: ``comm-opt``, ``mem-opt``, ``hybrid`` or ``auto`` (the cheapest per
            step under the alpha-beta and compute models). ``ekfac`` needs every worker
            to hold every basis (its hooks project their rows on them): ``comm-opt``.
        grad_workers: hybrid: workers per gradient-worker block (must divide the world).
        skip_layers: glob patterns of module names or class names to leave alone.
        probe: measure the alpha-beta model at start-up (else assume 1 Gbit/s).
        replan_every: communicating steps between drift checks of the dynamic fusion plan.
        graft: step-size grafting of ``kfac`` and ``ekfac``: ``none`` or ``adam`` (each
            layer's step takes the norm of Adam's normalised gradient; KL clipping off).
        beta1: Adam's first-moment decay (``soap``), in [0, 1).
        beta2: Adam's second-moment decay (``soap``, ``adam`` grafting), in [0, 1).
        eps: Adam's denominator epsilon (> 0).
        rest_lr_scale: ``soap``: the parameters outside the preconditioned layers (norms,
            batch-shared embeddings), which get plain Adam, step this many times the
            learning rate (> 0). Muon's recipe steps them with AdamW at Muon's own rate;
            on the GPT that rate is ten times SOAP's tuned one, and 10 reached the
            target in 20 steps where 1 took 25 (benchmarks/race/tune-soap-rest-gpt).
    """

    mode: Mode = Mode.KFAC
    damping: ScheduledValue = 1e-3
    factor_decay: ScheduledValue = 0.95
    kl_clip: ScheduledValue | None = 1e-3
    lr: ScheduledValue | None = None
    factor_interval: Interval | None = None
    inv_interval: Interval | None = None
    approximation: Approximation = Approximation.EXPAND
    method: Method | None = None
    inverse_form: InverseForm = InverseForm.AUTO
    comm: FactorComm = FactorComm.DYNAMIC
    sync: FactorSync = FactorSync.EAGER
    packed: bool = True
    comm_dtype: torch.dtype | None = None
    bucket_cap_mb: float = 25.0
    placement: PlacementPolicy = PlacementPolicy.LPT
    local_inversion: bool = True
    overlap: bool = True
    distribution: Distribution = Distribution.COMM_OPT
    grad_workers: int | None = None
    skip_layers: tuple[str, ...] = ()
    probe: bool = True
    replan_every: int = 10
    auto_overhead: float = 0.25
    auto_max_interval: int = 100
    auto_drift: float = 2.0
    auto_window: int = 20
    graft: Graft = Graft.NONE
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    rest_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("mode", _enum(Mode, self.mode, "mode"))
        set_("graft", _enum(Graft, self.graft, "graft"))
        set_("approximation", _enum(Approximation, self.approximation, "approximation"))
        if self.method is not None:
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
            elif value is not None:
                check_int(name, value)
        if self.auto_intervals and not all(
            isinstance(v, int | str) for v in (self.factor_every, self.inv_every)
        ):
            raise ValueError('"auto" intervals cannot be combined with a schedule callable')
        if not self.auto_overhead > 0:
            raise ValueError(f"auto_overhead must be > 0, got {self.auto_overhead}")
        check_int("auto_max_interval", self.auto_max_interval)
        if not self.auto_drift > 1:
            raise ValueError(f"auto_drift must be > 1, got {self.auto_drift}")
        check_int("auto_window", self.auto_window)
        check_float("rest_lr_scale", self.rest_lr_scale, low=0.0, low_open=True)
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.grad_workers is not None and self.grad_workers < 1:
            raise ValueError(f"grad_workers must be >= 1, got {self.grad_workers}")
        if self.replan_every < 1:
            raise ValueError(f"replan_every must be >= 1, got {self.replan_every}")
        self._check_mode()

    def _check_mode(self) -> None:
        for name in ("beta1", "beta2"):
            check_float(name, getattr(self, name), low=0.0, high=1.0)
        check_float("eps", self.eps, low=0.0, low_open=True)
        if self.mode.eigenbasis and self.method is Method.INVERSE:
            raise ValueError(
                f"mode {self.mode} works in the factors' eigenbases: it needs method=eigen "
                "(or leave method unset)"
            )
        if self.mode is Mode.EKFAC and self.distribution in (
            Distribution.MEM_OPT, Distribution.HYBRID
        ):  # fmt: skip
            raise ValueError(
                "mode ekfac projects every worker's factor rows on the eigenbases, so every "
                f"worker holds them: distribution comm-opt (or auto), not {self.distribution}"
            )
        if self.mode is Mode.SOAP and self.graft is not Graft.NONE:
            raise ValueError("mode soap is Adam in the eigenbasis: its step size is Adam's, "
                             "graft applies to kfac and ekfac")  # fmt: skip

    @property
    def decomposition(self) -> Method:
        """The decomposition in force: `method`, else the mode's (eigen for eigenbases)."""
        if self.method is not None:
            return self.method
        return Method.EIGEN if self.mode.eigenbasis else Method.INVERSE

    @property
    def factor_every(self) -> Interval:
        """The factor interval in force (`factor_interval`, else the mode's default)."""
        if self.factor_interval is not None:
            return self.factor_interval
        return DEFAULT_INTERVALS[self.mode][0]

    @property
    def inv_every(self) -> Interval:
        """The inversion interval in force (`inv_interval`, else the mode's default)."""
        if self.inv_interval is not None:
            return self.inv_interval
        return DEFAULT_INTERVALS[self.mode][1]

    @property
    def auto_intervals(self) -> bool:
        """Whether either interval is chosen by `plait.kfac.intervals`."""
        return AUTO in (self.factor_interval, self.inv_interval)

    def controller(self) -> IntervalController:
        """The interval policy these settings ask for: `AutoIntervals` where an interval is
        ``"auto"`` (a constant beside it stays fixed), else `FixedIntervals`."""
        f, i = self.factor_every, self.inv_every
        if not self.auto_intervals:
            return FixedIntervals(f, i)  # type: ignore[arg-type]
        return AutoIntervals(
            factor=f if isinstance(f, int) else None,
            inv=i if isinstance(i, int) else None,
            lazy=self.sync is FactorSync.LAZY,
            rho=self.auto_overhead,
            max_interval=self.auto_max_interval,
            drift=self.auto_drift,
            window=self.auto_window,
        )

    def placement_provider(self, costs: KFACCosts) -> PlacementProvider:
        """The placement policy these settings ask for, priced with `costs` (EKFAC's
        ``auto`` distribution is comm-opt: every worker projects on every basis)."""
        distribution = self.distribution
        if self.mode is Mode.EKFAC:
            distribution = Distribution.COMM_OPT
        return PlacementProvider(
            costs=costs, method=self.decomposition, packed=self.packed, policy=self.placement,
            distribution=distribution, grad_workers=self.grad_workers,
            local_inversion=self.local_inversion,
        )  # fmt: skip

    def constants(self) -> dict[str, Any]:
        """The plain-valued settings (for reports and checkpoints)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if callable(v) and not isinstance(v, type):
                continue
            out[f.name] = str(v) if isinstance(v, torch.dtype) else v
        return out
