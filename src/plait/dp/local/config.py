"""`LocalConfig`: the settings of local-update training (DiLoCo and its variants).

One frozen, self-validating object holds every choice, so a bad value fails where it is
written (the command line's spec, a library call) and never in a worker. The command line
spells it as a strategy spec, ``diloco:inner_steps=20,fragments=4,delay=2,compression=int4``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any


class Codec(StrEnum):
    """How a pseudo-gradient travels (`plait.dp.local.codecs`).

    ``none`` all-reduces it in fp32; ``fp16``/``bf16`` in half precision; ``int8``/``int4``
    quantise it per block (absmax scale) and average it in two exchanges (all-to-all, then
    all-gather), so each value crosses the wire at 8 or 4 bits both ways; ``topk`` sends
    the largest entries (a fraction `ratio`) by all-gather; ``lowrank`` sends ACP-SGD's
    alternating P or Q factor of every matrix (rank `rank`) by all-reduce.
    """

    NONE = "none"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    TOPK = "topk"
    LOWRANK = "lowrank"


class OuterOptimizer(StrEnum):
    """The optimizer the averaged pseudo-gradient drives (the *outer* step).

    ``nesterov``: SGD with Nesterov momentum, DiLoCo's choice (lr 0.7, momentum 0.9 in its
    paper); ``sgd``: SGD with heavy-ball momentum (lr 1, momentum 0 is plain parameter
    averaging, local SGD); ``adam``: Adam with `outer_lr` and betas (`outer_momentum`,
    0.999). A library caller may pass any optimizer factory instead (`LocalUpdate`).
    """

    NESTEROV = "nesterov"
    SGD = "sgd"
    ADAM = "adam"


def _enum(cls: Any, value: Any, name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        raise ValueError(
            f"{name} must be one of {', '.join(m.value for m in cls)}, got {value!r}"
        ) from None


def _int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _float(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if open_low else value >= low) and value <= high
    if not ok:
        bound = "(" if open_low else "["
        raise ValueError(f"{name} must be a number in {bound}{low:g}, {high:g}], got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LocalConfig:
    """Local-update training: H inner steps per worker, then an outer step on the average
    of the workers' pseudo-gradients (parameters before the round minus after).

    Attributes:
        inner_steps: H, inner optimizer steps between two synchronisations of a fragment.
        outer_lr: the outer optimizer's learning rate (0.7: DiLoCo's paper).
        outer_momentum: its momentum (Adam: beta1).
        outer_optimizer: see `OuterOptimizer`.
        fragments: the model is split into this many fragments (blocks of a layer stack,
            strided: fragment f holds blocks f, f + F, ...) synchronised on a stagger, one
            every H / F steps (Streaming DiLoCo); 1 synchronises everything at once.
        delay: tau, inner steps an exchange overlaps with before its result is applied
            (0: the round blocks on it); below H.
        mix: alpha, the share of the local copy kept when a delayed result arrives:
            local := alpha * local + (1 - alpha) * global. Used only with `delay`.
        compression: see `Codec`.
        error_feedback: keep what compression dropped and add it to the next round's
            pseudo-gradient (what makes biased compressors converge).
        rank: the rank of ``lowrank`` compression.
        ratio: the fraction of entries ``topk`` sends, in (0, 1].
        block: values per scale of ``int8``/``int4`` quantisation.
        timeout_s: how long a round may wait for its exchange before failing.
    """

    inner_steps: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_optimizer: OuterOptimizer = OuterOptimizer.NESTEROV
    fragments: int = 1
    delay: int = 0
    mix: float = 0.5
    compression: Codec = Codec.NONE
    error_feedback: bool = True
    rank: int = 16
    ratio: float = 0.01
    block: int = 128
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "outer_optimizer", _enum(OuterOptimizer, self.outer_optimizer, "outer_optimizer")
        )
        object.__setattr__(self, "compression", _enum(Codec, self.compression, "compression"))
        _int("inner_steps", self.inner_steps, 1)
        _int("fragments", self.fragments, 1)
        _int("delay", self.delay, 0)
        _int("rank", self.rank, 1)
        _int("block", self.block, 2)
        _float("outer_lr", self.outer_lr, 0.0, 1e3, open_low=True)
        _float("outer_momentum", self.outer_momentum, 0.0, 1.0)
        if self.outer_momentum >= 1:
            raise ValueError(f"outer_momentum must be < 1, got {self.outer_momentum}")
        _float("mix", self.mix, 0.0, 1.0)
        _float("ratio", self.ratio, 0.0, 1.0, open_low=True)
        _float("timeout_s", self.timeout_s, 0.0, 1e6, open_low=True)
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be true or false, got {self.error_feedback!r}")
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"fragments ({self.fragments}) must be <= inner_steps ({self.inner_steps}): "
                "each fragment synchronises once per round of H steps, on its own step"
            )
        if self.delay >= self.inner_steps:
            raise ValueError(
                f"delay ({self.delay}) must be below inner_steps ({self.inner_steps}): a "
                "fragment's exchange must land before its next one starts"
            )

    @classmethod
    def option_names(cls) -> list[str]:
        """The keyword options a spec may give (``inner_steps``, ``compression``, ...)."""
        return [f.name for f in fields(cls)]

    def describe(self) -> str:
        """A short label: ``H=20, F=4, tau=2, int4``."""
        parts = [f"H={self.inner_steps}"]
        if self.fragments > 1:
            parts.append(f"F={self.fragments}")
        if self.delay:
            parts.append(f"tau={self.delay}")
        if self.compression is not Codec.NONE:
            parts.append(self.compression.value)
        return ", ".join(parts)
