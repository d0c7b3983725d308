"""Per-model hyper-parameters: one value for every model, or one value per model.

Optimizers, schedulers and dropout accept a scalar or a length-B sequence for each
hyper-parameter. They are normalised here once, with an error naming the parameter when
the length is wrong, and turned into [B, 1, ...] coefficient tensors so that one fused
kernel applies every model's own value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import torch

PerModel: TypeAlias = float | Sequence[float] | torch.Tensor


def is_number(x: object) -> bool:
    """An int or float hyper-parameter value (bool is not one, though Python counts it)."""
    return isinstance(x, int | float) and not isinstance(x, bool)


def per_model(value: object, *, num_models: int, name: str) -> list[float]:
    """`value` as a list of `num_models` floats.

    Args:
        value: a number (shared by every model), a sequence of one number per model, or a
            0-d or 1-d tensor.
        num_models: B, the number of models of the array.
        name: the hyper-parameter's name, for error messages.

    Raises:
        ValueError: the sequence's length is not B, or a value is not a number.
    """
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number or a sequence of numbers, got {value!r}")
    if isinstance(value, int | float):
        return [float(value)] * num_models
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(f"{name} must be a number or a sequence of numbers, got {value!r}")
    values = list(value)
    if len(values) != num_models:
        raise ValueError(
            f"{name} has {len(values)} values but the array holds {num_models} models: "
            f"give one number for all models or exactly {num_models}"
        )
    out: list[float] = []
    for v in values:
        if not is_number(v):
            raise ValueError(f"{name} must hold numbers, got {v!r}")
        out.append(float(v))
    return out


def per_model_ints(value: object, *, num_models: int, name: str) -> list[int]:
    """Like `per_model` for integer settings (step sizes, cycle lengths)."""
    floats = per_model(value, num_models=num_models, name=name)
    if any(f != int(f) for f in floats):
        raise ValueError(f"{name} must hold integers, got {value!r}")
    return [int(f) for f in floats]


def per_model_pairs(value: object, *, num_models: int, name: str) -> list[tuple[float, float]]:
    """A pair such as Adam's betas: one pair for all models, or one pair per model."""
    if isinstance(value, Sequence) and len(value) == 2 and all(is_number(v) for v in value):
        pair = (float(value[0]), float(value[1]))
        return [pair] * num_models
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(f"{name} must be a pair or a sequence of pairs, got {value!r}")
    if len(value) != num_models:
        raise ValueError(
            f"{name} has {len(value)} pairs but the array holds {num_models} models: "
            f"give one pair for all models or exactly {num_models}"
        )
    out: list[tuple[float, float]] = []
    for v in value:
        if not isinstance(v, Sequence) or len(v) != 2:
            raise ValueError(f"{name} must hold pairs, got {v!r}")
        out.append((float(v[0]), float(v[1])))
    return out


def compact(values: Sequence[float]) -> float | list[float]:
    """One number when every model shares it (the common case reads like torch.optim)."""
    first = values[0]
    return first if all(v == first for v in values) else list(values)


def coefficient(values: Sequence[float], like: torch.Tensor, ndim: int = 2) -> torch.Tensor:
    """Per-model values as a [B, 1, ...] tensor of `ndim` dims on `like`'s device.

    Computed in float64 and rounded once to `like`'s dtype, as torch.optim's Python-float
    arithmetic is, so fused and stock updates agree to the last bit or two.
    """
    t = torch.tensor(values, dtype=torch.float64).to(device=like.device, dtype=like.dtype)
    return t.view(-1, *([1] * (ndim - 1)))
