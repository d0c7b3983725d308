"""Local-update data parallelism: DiLoCo, Streaming DiLoCo and local SGD.

``plait.data_parallel(model, "diloco", inner_steps=50)`` in place of
``DistributedDataParallel(model)``: workers train alone for H steps, then average their
pseudo-gradients (optionally compressed, with error feedback) into an outer optimizer
step. See `LocalUpdate` for the method and `LocalConfig` for its settings.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.dp.local.codecs import PseudoGradientCodec, make_codec
from plait.dp.local.config import Codec, LocalConfig, OuterOptimizer
from plait.dp.local.update import STATE_KEY, LocalUpdate, OuterFactory

#: The local-update methods by name, with the settings that define them (a caller's
#: options override them): DiLoCo (outer Nesterov SGD, lr 0.7, momentum 0.9) and local
#: SGD (the outer step is plain parameter averaging).
METHODS: dict[str, dict[str, Any]] = {
    "diloco": {},
    "localsgd": {"outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0},
}


def local_config(method: str = "diloco", **options: Any) -> LocalConfig:
    """The `LocalConfig` of `method` with `options` applied.

    Raises:
        ValueError: an unknown method or option, or a bad value.
    """
    if method not in METHODS:
        raise ValueError(f"unknown local-update method {method!r}; choose from {sorted(METHODS)}")
    unknown = sorted(set(options) - set(LocalConfig.option_names()))
    if unknown:
        raise ValueError(
            f"unknown option {unknown[0]!r} for {method!r} "
            f"(accepted: {', '.join(LocalConfig.option_names())})"
        )
    return LocalConfig(**{**METHODS[method], **options})


def local_update(
    model: nn.Module,
    method: str = "diloco",
    *,
    group: Any = None,
    outer_factory: OuterFactory | None = None,
    **options: Any,
) -> LocalUpdate:
    """Wrap `model` for local-update training (`method`: ``diloco`` or ``localsgd``).

    Raises:
        ValueError: as `local_config` and `LocalUpdate`.
    """
    return LocalUpdate(
        model, local_config(method, **options), group=group, outer_factory=outer_factory
    )


__all__ = [
    "METHODS",
    "STATE_KEY",
    "Codec",
    "LocalConfig",
    "LocalUpdate",
    "OuterFactory",
    "OuterOptimizer",
    "PseudoGradientCodec",
    "local_config",
    "local_update",
    "make_codec",
]
