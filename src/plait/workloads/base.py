"""The workload object: a model family, its data, its loss and metric, its defaults.

Every command and every system that needs "a model and its data" takes a `Workload`:
`plait train`, `plait bench`, `plait crossover`, `plait plan`, `plait sweep` and
`plait bench-fused`. plait's own workloads are registered instances of it; a user's
factory (``pkg.module:factory`` or ``path/to/file.py:factory``) returns one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset

Batch = tuple[torch.Tensor, torch.Tensor]


class Task(StrEnum):
    """What the model predicts: decides the default loss and metric."""

    CLASSIFICATION = "classification"
    LANGUAGE_MODEL = "language_model"


@dataclass(frozen=True, kw_only=True)
class DataInfo:
    """What a model needs to know about its inputs.

    Attributes:
        input_shape: one sample's input shape (without the batch dimension).
        num_classes: classes, or the vocabulary of a language model's targets.
        block_size: sequence length of a language model (0 otherwise).
        input_vocab: inputs are token ids below this bound (0: real-valued inputs).
    """

    input_shape: tuple[int, ...]
    num_classes: int
    block_size: int = 0
    input_vocab: int = 0

    def random_inputs(self, *batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Inputs of these shapes with `batch` leading dimensions (throughput runs only)."""
        shape = (*batch, *self.input_shape)
        vocab = self.input_vocab or (self.num_classes if self.block_size else 0)
        if vocab:
            return torch.randint(0, vocab, shape, generator=generator)
        return torch.randn(shape, generator=generator)


@dataclass(frozen=True, kw_only=True)
class DataSplit:
    """Train and held-out data with their shapes; `name` says where they come from."""

    train: Dataset[Any]
    test: Dataset[Any] | None
    info: DataInfo
    name: str


def logits_of(output: Any) -> torch.Tensor:
    """The prediction tensor of a model's output.

    Models nobody here wrote return more than a tensor: Hugging Face models return a
    `ModelOutput` (or a dict, or a tuple with ``return_dict=False``) whose logits sit under
    ``logits``; plain models return the tensor itself.
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else None
    if logits is None:
        logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, tuple | list) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"cannot find the predictions in a model output of type {type(output).__name__}: "
            "return a tensor, or an object or dict with a 'logits' tensor, or give the "
            "workload a loss function"
        )
    return logits


def default_loss(task: Task) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """Cross-entropy over classes, or over every token of a language model."""

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output)
        if task is Task.LANGUAGE_MODEL:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        return F.cross_entropy(logits, target)

    return loss


def accuracy(output: Any, target: torch.Tensor) -> tuple[int, int]:
    """(correct predictions, predictions): accuracy, per token for language models."""
    pred = logits_of(output).argmax(dim=-1)
    return int((pred == target).sum()), target.numel()


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model family with its data and defaults: the one kind of registry entry.

    Attributes:
        name: the `--workload` name.
        build: the model for the data's shapes, ``build(info, **arch)``; `arch` holds
            architecture options a sweep may vary (e.g. ``width``), defaults in `arch`.
        real: real train/held-out data (bundled with a package: nothing downloads).
        synthetic: data of the benchmark shapes, given a sample count; without it,
            benchmarks reuse the real training set.
        task: decides the default loss and metric.
        description: one line for listings.
        loss_fn: ``loss(output, target)``; default: cross-entropy by `task`, reading a
            `ModelOutput`'s or dict's ``logits``.
        metric_fn: ``metric(output, target) -> (correct, total)``; default: accuracy.
        tensor_parallel_plan: ``plan(model) -> {module path: ParallelStyle}`` for tensor
            parallelism; default: derived from the model's structure where it can be.
        bench_build: a benchmark-sized variant of `build`, if it differs.
        bench_batch: per-worker batch size of benchmarks.
        train_batch: per-worker batch size of `plait train`.
        lr: default learning rate; optimizer: default optimizer name.
        epochs: default training epochs on real data.
        arch: default architecture options passed to `build`.
    """

    name: str
    build: Callable[..., nn.Module]
    real: Callable[[], DataSplit]
    synthetic: Callable[[int], DataSplit] | None = None
    task: Task = Task.CLASSIFICATION
    description: str = ""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    metric_fn: Callable[[Any, torch.Tensor], tuple[int, int]] | None = None
    tensor_parallel_plan: Callable[[nn.Module], Mapping[str, Any]] | None = None
    bench_build: Callable[..., nn.Module] | None = None
    bench_batch: int = 32
    train_batch: int = 32
    lr: float = 0.05
    optimizer: str = "sgd"
    epochs: int = 10
    arch: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a workload needs a non-empty name, got {self.name!r}")
        for attr in ("build", "real"):
            if not callable(getattr(self, attr)):
                raise ValueError(f"workload {self.name!r}: {attr} must be callable")
        for attr in ("bench_batch", "train_batch", "epochs"):
            if int(getattr(self, attr)) < 1:
                raise ValueError(f"workload {self.name!r}: {attr} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"workload {self.name!r}: lr must be > 0, got {self.lr}")
        if self.optimizer not in ("sgd", "adam", "adamw"):
            raise ValueError(
                f"workload {self.name!r}: optimizer {self.optimizer!r}; "
                "choose from sgd, adam, adamw"
            )

    def model(self, info: DataInfo, *, bench: bool = False, **arch: Any) -> nn.Module:
        """The model for `info`; with `bench`, the benchmark-sized variant if there is one."""
        options = {**self.arch, **arch}
        build = self.bench_build if bench and self.bench_build is not None else self.build
        model = build(info, **options)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"workload {self.name!r}: its model builder returned "
                f"{type(model).__name__}, not a torch.nn.Module"
            )
        return model

    def bench_data(self, samples: int) -> DataSplit:
        """Benchmark data: `synthetic`, or the first `samples` real training samples."""
        if self.synthetic is not None:
            return self.synthetic(samples)
        real = self.real()
        n = min(samples, len(real.train))  # type: ignore[arg-type]
        return DataSplit(
            train=Subset(real.train, range(n)), test=None, info=real.info, name=real.name
        )

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The training loss of one batch."""
        fn = self.loss_fn or default_loss(self.task)
        return fn(output, target)

    def correct(self, output: Any, target: torch.Tensor) -> tuple[int, int]:
        """(correct, total) of one batch: the held-out metric's counts."""
        fn = self.metric_fn or accuracy
        return fn(output, target)
