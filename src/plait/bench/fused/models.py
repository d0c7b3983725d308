"""The benchmark's models: registry workloads (`plait.workloads`), sized for sweeps.

`plait bench-fused` measures models small enough that one leaves a device mostly idle.
It takes any workload of the registry (a built-in name or a user factory
``pkg.module:factory`` / ``path/to/file.py:factory``) and, for brevity and continuity
with earlier reports, six short names that map onto the ``digits-*`` workloads at a
fixed ``width``:

==================  ======================  =====  ==============================
name                workload                width  model
==================  ======================  =====  ==============================
mlp                 digits-mlp              64     MLP 64-64-64-10
mlp-wide            digits-mlp              128    MLP 64-128-128-10
cnn                 digits-cnn              8      ResNet-style CNN, batch norm
cnn-wide            digits-cnn              16     the same, twice as wide
transformer         digits-transformer      16     2 layers x 16, 2 heads
transformer-wide    digits-transformer      32     2 layers x 32, 4 heads
==================  ======================  =====  ==============================

The short names take precedence over registry names: ``mlp`` here is the sweep-sized
MLP above, not the registry's 8.4 M-parameter ``mlp`` workload. A workload given by its
own name trains its default model (``build``, not the data-parallel benchmarks'
``bench_build``) on its benchmark inputs' shapes: synthetic inputs of
`DataInfo.random_inputs` (throughput only; the values never matter).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
from torch import nn

from plait.workloads import DataInfo, Workload, get_workload, is_factory_spec

#: Short benchmark names -> (registry workload, architecture options).
MODEL_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("digits-mlp", {"width": 64}),
    "cnn": ("digits-cnn", {"width": 8}),
    "transformer": ("digits-transformer", {"width": 16}),
    "mlp-wide": ("digits-mlp", {"width": 128}),
    "cnn-wide": ("digits-cnn", {"width": 16}),
    "transformer-wide": ("digits-transformer", {"width": 32}),
}

#: Samples the benchmark asks a workload's data for, only to learn the input shapes.
_PROBE_SAMPLES = 8


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """A benchmark model: a registry workload at given architecture options.

    Attributes:
        name: the name it was asked by (a short name, a workload name or a factory spec);
            a worker process resolves the same model from it.
        workload: the registry workload.
        arch: architecture options passed to its builder.
        info: its inputs' shapes.
        description: one line for reports.
        batch_size: per-model batch size (the workload's benchmark batch).
    """

    name: str
    workload: Workload
    info: DataInfo
    description: str
    arch: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int = 32

    @property
    def num_classes(self) -> int:
        return self.info.num_classes

    def build(self) -> nn.Module:
        """One model (seed torch first for reproducible weights)."""
        return self.workload.model(self.info, **self.arch)

    def inputs(self, models: int, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Synthetic inputs [models, batch, ...] of the workload's input shape."""
        return self.info.random_inputs(models, batch, generator=generator)

    def targets(self, models: int, batch: int, generator: torch.Generator) -> torch.Tensor:
        """Synthetic targets [models, batch]: classes, or a language model's next tokens
        [models, batch, block_size]."""
        shape = (models, batch, self.info.block_size) if self.info.block_size else (models, batch)
        return torch.randint(0, self.num_classes, shape, generator=generator)


@cache
def get_model(name: str) -> BenchModel:
    """The benchmark model of a short name (`MODEL_ALIASES`) or a registry workload.

    Cached: the benchmark asks for a model once per configuration and every worker
    process once, and a user workload without synthetic data loads its real data here.

    Raises:
        ValueError: neither a short name nor a workload the registry resolves.
    """
    spec, arch = MODEL_ALIASES.get(name, (name, {}))
    try:
        workload = get_workload(spec)
    except ValueError as e:
        if is_factory_spec(spec):
            raise  # the registry's message names the module, file or attribute
        raise ValueError(
            f"unknown benchmark model {name!r}; choose from {', '.join(MODEL_ALIASES)}, a "
            f"registry workload or a factory pkg.module:factory / file.py:factory ({e})"
        ) from None
    info = workload.bench_data(_PROBE_SAMPLES).info
    options = {**workload.arch, **arch}
    params = sum(p.numel() for p in workload.model(info, **options).parameters())
    shown = ", ".join(f"{k} {v}" for k, v in options.items())
    description = f"{workload.name}{f' ({shown})' if shown else ''}: {params / 1e3:.1f} k params"
    return BenchModel(
        name=name,
        workload=workload,
        info=info,
        description=description,
        arch=arch,
        batch_size=workload.bench_batch,
    )
