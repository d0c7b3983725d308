"""plait's own workloads, registered like any user's.

Benchmark shapes keep the layer shapes of the model a workload is named after (so gradient
and factor sizes match the papers) but use small inputs and batches, so one strategy at one
network setting measures in about a minute on a 2-core machine. Real data (scikit-learn's
digits, the pydoc text shipped with Python) is for convergence and fidelity runs.

The ``digits-*`` workloads are sweep-sized: one of them leaves a device mostly idle, which
is what fused arrays (`plait.fused`) exploit. Their ``width`` is an architecture option a
sweep may vary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from plait.data import (
    load_digits_split,
    load_text_split,
    synthetic_classification,
    synthetic_tokens,
)
from plait.models import GPT, MLP, VGG, GPTConfig, ResNet18
from plait.models.small import DigitsCNN, TransformerClassifier
from plait.workloads.base import DataInfo, DataSplit, Task, Workload


def _digits(image: bool) -> Callable[[], DataSplit]:
    def load() -> DataSplit:
        train, test = load_digits_split(image=image)
        shape = (1, 8, 8) if image else (64,)
        return DataSplit(
            train=train, test=test, info=DataInfo(input_shape=shape, num_classes=10), name="digits"
        )

    return load


def _digit_tokens() -> DataSplit:
    """Digits as sequences of 64 pixel tokens (the raw data's 17 grey levels)."""
    train, test = load_digits_split(image=False)

    def tokens(ds: TensorDataset) -> TensorDataset:
        x, y = ds.tensors
        return TensorDataset(torch.round(x * 16).long(), y)

    info = DataInfo(input_shape=(64,), num_classes=10, input_vocab=17)
    return DataSplit(train=tokens(train), test=tokens(test), info=info, name="digits-tokens")


def _images(shape: tuple[int, ...]) -> Callable[[int], DataSplit]:
    def make(n: int) -> DataSplit:
        ds = synthetic_classification(n=n, input_shape=shape, num_classes=10)
        info = DataInfo(input_shape=shape, num_classes=10)
        return DataSplit(train=ds, test=None, info=info, name="synthetic")

    return make


def _token_classes(seq: int, vocab: int) -> Callable[[int], DataSplit]:
    def make(n: int) -> DataSplit:
        x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))
        y = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(1))
        info = DataInfo(input_shape=(seq,), num_classes=10, input_vocab=vocab)
        return DataSplit(train=TensorDataset(x, y), test=None, info=info, name="synthetic")

    return make


_BENCH_GPT = {"n_layer": 6, "n_head": 6, "n_embd": 384}
_TRAIN_GPT = {"n_layer": 4, "n_head": 4, "n_embd": 256}


def _gpt(sizes: dict[str, int]) -> Callable[[DataInfo], nn.Module]:
    def build(info: DataInfo) -> nn.Module:
        return GPT(GPTConfig(vocab_size=info.num_classes, block_size=info.block_size, **sizes))

    return build


def _text(block_size: int) -> Callable[[], DataSplit]:
    def load() -> DataSplit:
        train, val, vocab = load_text_split(block_size=block_size)
        info = DataInfo(input_shape=(block_size,), num_classes=vocab.size, block_size=block_size)
        return DataSplit(train=train, test=val, info=info, name="pydoc-topics")

    return load


def _tokens(block_size: int, vocab: int) -> Callable[[int], DataSplit]:
    def make(n: int) -> DataSplit:
        ds = synthetic_tokens(n=n, block_size=block_size, vocab_size=vocab)
        info = DataInfo(input_shape=(block_size,), num_classes=vocab, block_size=block_size)
        return DataSplit(train=ds, test=None, info=info, name="synthetic")

    return make


def _features(info: DataInfo) -> int:
    return int(torch.tensor(info.input_shape).prod())


def _mlp(hidden: tuple[int, ...]) -> Callable[[DataInfo], nn.Module]:
    def build(info: DataInfo) -> nn.Module:
        return MLP(in_features=_features(info), hidden=hidden, num_classes=info.num_classes)

    return build


def _resnet(info: DataInfo) -> nn.Module:
    return ResNet18(in_channels=info.input_shape[0], num_classes=info.num_classes)


def _vgg(info: DataInfo) -> nn.Module:
    return VGG(
        config="vgg16",
        in_channels=info.input_shape[0],
        num_classes=info.num_classes,
        image_size=info.input_shape[-1],
    )


def _digits_mlp(info: DataInfo, *, width: int = 128, **_: Any) -> nn.Module:
    return MLP(in_features=_features(info), hidden=(width, width), num_classes=info.num_classes)


def _digits_cnn(info: DataInfo, *, width: int = 8, **_: Any) -> nn.Module:
    return DigitsCNN(width=width, in_channels=info.input_shape[0], num_classes=info.num_classes)


def _digits_transformer(info: DataInfo, *, width: int = 16, **_: Any) -> nn.Module:
    return TransformerClassifier(
        vocab_size=info.input_vocab,
        seq_len=info.input_shape[0],
        d_model=width,
        nhead=max(1, width // 8),
        dim_feedforward=2 * width,
        num_classes=info.num_classes,
    )


BUILTIN: tuple[Workload, ...] = (
    Workload(
        name="mlp",
        description="MLP; bench 2048-2048-1024 (8.4 M params), train 512-256 on digits",
        task=Task.CLASSIFICATION,
        build=_mlp((512, 256)),
        bench_build=_mlp((2048, 2048, 1024)),
        real=_digits(image=False),
        synthetic=_images((1024,)),
        bench_batch=32,
        train_batch=32,
        lr=0.05,
        epochs=10,
    ),
    Workload(
        name="resnet18",
        description="CIFAR ResNet-18 (11.2 M params), 3x32x32 synthetic; digits as 1x8x8",
        task=Task.CLASSIFICATION,
        build=_resnet,
        real=_digits(image=True),
        synthetic=_images((3, 32, 32)),
        bench_batch=8,
        train_batch=32,
        lr=0.05,
        epochs=5,
    ),
    Workload(
        name="vgg",
        description="CIFAR VGG-16 with batch norm (14.7 M params); digits as 1x8x8",
        task=Task.CLASSIFICATION,
        build=_vgg,
        real=_digits(image=True),
        synthetic=_images((3, 32, 32)),
        bench_batch=8,
        train_batch=32,
        lr=0.05,
        epochs=5,
    ),
    Workload(
        name="gpt",
        description="character GPT; bench 6x384 (10.7 M params), train 4x256 on pydoc text",
        task=Task.LANGUAGE_MODEL,
        build=_gpt(_TRAIN_GPT),
        bench_build=_gpt(_BENCH_GPT),
        real=_text(block_size=128),
        synthetic=_tokens(block_size=64, vocab=128),
        bench_batch=4,
        train_batch=16,
        lr=1e-3,
        optimizer="adamw",
        epochs=1,
    ),
    Workload(
        name="digits-mlp",
        description="sweep-sized MLP 64-W-W-10 on digits (W = width, default 128)",
        build=_digits_mlp,
        real=_digits(image=False),
        synthetic=_images((64,)),
        arch={"width": 128},
    ),
    Workload(
        name="digits-cnn",
        description="sweep-sized ResNet-style CNN with batch norm on 1x8x8 digits (width 8)",
        build=_digits_cnn,
        real=_digits(image=True),
        synthetic=_images((1, 8, 8)),
        arch={"width": 8},
    ),
    Workload(
        name="digits-transformer",
        description="sweep-sized Transformer encoder classifier, 2 layers x W (width 16); "
        "digits as 64 pixel tokens, benchmarks on 16 tokens of 64",
        build=_digits_transformer,
        real=_digit_tokens,
        synthetic=_token_classes(seq=16, vocab=64),
        arch={"width": 16},
    ),
)
