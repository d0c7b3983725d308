"""K-FAC's per-layer kernels on one core: factor sums, decompositions, preconditioning.

Each row times the kernel plait uses against the textbook one on a real model's layer
shapes, side by side in one process with one intra-op thread (what each emulated worker
gets), median of `repeats`:

- A factor: ``X^T X`` then packing its upper triangle, against `triangle.syrk` writing the
  packed triangle directly;
- decomposition of A and G: Cholesky plus explicit inverse, against `decompose` (the
  Cholesky factor alone);
- preconditioning ``G^-1 M A^-1``: products with the two inverses, against `precondition`
  (triangular solves).

    plait bench kfac-kernels [--workload resnet18] [--out DIR]
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from plait.bench import suites
from plait.bench.core import Stats
from plait.bench.records import KernelRecord, KernelReport, RunMeta
from plait.flags import option
from plait.kfac import triangle
from plait.kfac.factors import Method, SecondOrder, decompose, pack, precondition
from plait.kfac.layers import KFACLayer, make_layer
from plait.records import write_report
from plait.workloads import get_workload


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return Stats.of(times).median


def _layer_inputs(workload: str) -> list[tuple[KFACLayer, torch.Tensor]]:
    """Every K-FAC layer of the workload's model with its input at the bench batch size
    (but embeddings: a diagonal A has no factor product, decomposition or solve to time)."""
    wl = get_workload(workload)
    data = wl.bench_data(wl.bench_batch)
    model = wl.model(data.info, bench=True)
    x = torch.stack([data.train[i][0] for i in range(wl.bench_batch)])
    captured: list[tuple[KFACLayer, torch.Tensor]] = []
    handles = []
    for name, module in model.named_modules():
        layer = make_layer(name, module)
        if layer is None or layer.a_shape.diagonal:
            continue

        def hook(_m: nn.Module, inputs: tuple[Any, ...], _o: Any, layer: KFACLayer = layer) -> None:
            captured.append((layer, inputs[0].detach()))

        handles.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return captured


def _spd(rows: torch.Tensor) -> torch.Tensor:
    return triangle.unpack(triangle.syrk(rows), rows.shape[-1], rows.shape[0]) / rows.shape[1]


def _layer_record(layer: KFACLayer, x: torch.Tensor, repeats: int) -> KernelRecord:
    """Seconds of each kernel pair on one layer. The A factor comes from the layer's real
    input; G, whose values do not change what the kernels cost, from random rows."""
    rows = layer.a_rows(x)
    a_shape, g_shape = layer.a_shape, layer.g_shape
    a = _spd(rows)
    g = _spd(torch.randn(g_shape.groups, 2 * g_shape.dim, g_shape.dim))
    grad = torch.randn(a_shape.groups, g_shape.dim, a_shape.dim)
    damping = 1e-2
    root = math.sqrt(damping)

    def inverse(f: torch.Tensor) -> torch.Tensor:
        chol = torch.linalg.cholesky(f + root * torch.eye(f.shape[-1]), upper=True)
        return torch.cholesky_inverse(chol, upper=True)

    def textbook_inverses() -> tuple[torch.Tensor, torch.Tensor]:
        return inverse(a), inverse(g)

    def plait_decompositions() -> tuple[SecondOrder, SecondOrder]:
        return (
            decompose(a, a_shape, method=Method.INVERSE, damping=damping, packed=True),
            decompose(g, g_shape, method=Method.INVERSE, damping=damping, packed=True),
        )

    a_inv, g_inv = textbook_inverses()
    a_so, g_so = plait_decompositions()
    return KernelRecord(
        layer=layer.name,
        rows=int(rows.shape[1]),
        a_dim=a_shape.dim,
        g_dim=g_shape.dim,
        groups=a_shape.groups,
        factor_dense_s=_median_s(
            lambda: pack(torch.matmul(rows.transpose(1, 2), rows), a_shape), repeats
        ),
        factor_tiled_s=_median_s(lambda: triangle.syrk(rows), repeats),
        decompose_inverse_s=_median_s(textbook_inverses, repeats),
        decompose_cholesky_s=_median_s(plait_decompositions, repeats),
        precondition_inverse_s=_median_s(lambda: g_inv @ grad @ a_inv, repeats),
        precondition_solves_s=_median_s(lambda: precondition(grad, a_so, g_so), repeats),
    )


def measure(*, workload: str, repeats: int = 5, progress: bool = True) -> list[KernelRecord]:
    """One record per layer: seconds of each kernel pair (a progress bar over the layers)."""
    torch.set_num_threads(1)
    layers = _layer_inputs(workload)
    bar = tqdm(layers, desc=f"kernels {workload}", unit="layer", leave=False, disable=not progress)
    return [_layer_record(layer, x, repeats) for layer, x in bar]


_PAIRS = [
    ("A factor", "factor_dense_s", "factor_tiled_s"),
    ("decomposition of A and G", "decompose_inverse_s", "decompose_cholesky_s"),
    ("preconditioning G^-1 M A^-1", "precondition_inverse_s", "precondition_solves_s"),
]


def markdown(records: list[KernelRecord]) -> str:
    """The totals over all layers per kernel pair, then the per-layer seconds."""
    out = ["| kernel | textbook s | plait s | speed-up |\n|---|---|---|---|\n"]
    for title, old, new in _PAIRS:
        a = sum(getattr(r, old) for r in records)
        b = sum(getattr(r, new) for r in records)
        out.append(f"| {title}, all layers | {a:.3f} | {b:.3f} | {a / b:.2f}x |\n")
    out.append("\nPer layer (seconds; rows x A dim, G dim):\n\n")
    out.append(
        "| layer | factor shape | X^T X + pack | tiled | chol + inverse | chol | "
        "inverse products | solves |\n|---|---|---|---|---|---|---|---|\n"
    )
    for r in records:
        out.append(
            f"| {r.layer} | {r.rows} x {r.a_dim}, {r.g_dim}"
            + (f" ({r.groups} groups)" if r.groups > 1 else "")
            + "".join(f" | {getattr(r, k):.4f}" for _, o, n in _PAIRS for k in (o, n))
            + " |\n"
        )
    return "".join(out)


@dataclass(frozen=True, kw_only=True)
class KernelsConfig:
    """The command line of ``plait bench kfac-kernels`` (`plait.flags`).

    Attributes:
        workload: the workload whose layers' shapes are timed.
        repeats: timings of every kernel (the median is reported); at least one.
        out: the report's folder (default: print the table only).

    Raises:
        ValueError: `repeats` below 1.
    """

    workload: str = option("resnet18")
    repeats: int = option(5)
    out: Path | None = option(None)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("--repeats must be >= 1")


def run_parsed(cfg: KernelsConfig, call: suites.Call) -> int:
    """Time every layer's kernels, print the table and, with ``--out``, write the report."""
    records = measure(workload=cfg.workload, repeats=cfg.repeats)
    command = call.command
    meta = RunMeta(workload=cfg.workload).stamped(command=command)
    text = markdown(records)
    footer = f"\ncommit {meta.commit}, torch {meta.torch}, 1 intra-op thread\n"
    print(text + footer, end="")
    if cfg.out is not None:
        write_report(
            cfg.out,
            KernelReport(meta=meta, layers=records).to_dict(),
            title=f"K-FAC kernels on {cfg.workload}'s layers, one core",
            command=command,
            body=text,
            footer=footer,
            indent=1,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.kfac_kernels``: the suite ``kfac-kernels``
    (`plait.bench.suites`)."""
    return suites.main("kfac-kernels", argv)


if __name__ == "__main__":
    sys.exit(main())
