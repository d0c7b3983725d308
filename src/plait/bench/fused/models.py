"""The benchmark models: small enough that one of them leaves a device mostly idle.

Each is a sweep-sized model on digits-shaped inputs: an MLP, a ResNet-style CNN with
batch norm, and a Transformer encoder classifier. Inputs are synthetic (throughput only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from plait.models import MLP
from plait.models.small import DigitsCNN, TransformerClassifier


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """A benchmark model: its builder, a per-model input batch maker and its batch size."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int, torch.Generator], torch.Tensor]  # (models, batch, gen) -> x
    batch_size: int = 32
    num_classes: int = 10


def _images(b: int, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(b, n, 1, 8, 8, generator=g)


def _tokens(b: int, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 64, (b, n, 16), generator=g)


def _mlp(width: int) -> Callable[[], nn.Module]:
    return lambda: MLP(in_features=64, hidden=(width, width), num_classes=10)


def _cnn(width: int) -> Callable[[], nn.Module]:
    return lambda: DigitsCNN(width=width)


def _transformer(width: int) -> Callable[[], nn.Module]:
    return lambda: TransformerClassifier(d_model=width, nhead=width // 8, dim_feedforward=2 * width)


def _params(build: Callable[[], nn.Module]) -> str:
    return f"{sum(p.numel() for p in build().parameters()) / 1e3:.1f} k params"


def _models() -> list[BenchModel]:
    out = []
    for suffix, (w_mlp, w_cnn, w_tf) in {"": (64, 8, 16), "-wide": (128, 16, 32)}.items():
        mlp, cnn, tf = _mlp(w_mlp), _cnn(w_cnn), _transformer(w_tf)
        out += [
            BenchModel(name=f"mlp{suffix}", build=mlp, inputs=_images,
                       description=f"MLP 64-{w_mlp}-{w_mlp}-10 on 8x8 digits ({_params(mlp)})"),
            BenchModel(name=f"cnn{suffix}", build=cnn, inputs=_images,
                       description=f"ResNet-style CNN, width {w_cnn}, batch norm, 1x8x8 digits "
                                   f"({_params(cnn)})"),
            BenchModel(name=f"transformer{suffix}", build=tf, inputs=_tokens,
                       description=f"Transformer encoder, 2 layers x {w_tf} wide, {w_tf // 8} "
                                   f"heads, 16 tokens ({_params(tf)})"),
        ]  # fmt: skip
    return out


#: mlp, cnn, transformer: sweep-sized; the -wide variants double the width.
BENCH_MODELS: dict[str, BenchModel] = {m.name: m for m in _models()}


def get_model(name: str) -> BenchModel:
    try:
        return BENCH_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown benchmark model {name!r}; choose from {', '.join(BENCH_MODELS)}"
        ) from None
