"""Fidelity of fused arrays: each member against the same model trained alone.

N models of a workload train `steps` steps with per-model learning rates twice, as one
fused array (`plait.fuse` with plait's fused optimizer) and one by one (stock modules,
torch.optim), on the same synthetic batches; a third run trains the stock models in
float64. The report gives, per optimizer, the largest relative difference of any
member's parameters and buffers (max |a - b| / max |b| per tensor, max |b| at least a
thousandth of the member's largest value: `SCALE_FLOOR`) between

- fused and stock, both float32 (the goal: within 1e-5),
- stock float32 and stock float64 (how far float32 itself is from exact arithmetic),
- fused float32 and stock float64,
- fused and stock, both float64 (0 up to float64 rounding when the two compute the same
  function; the bound that remains when float32 cannot meet 1e-5, as with max pooling's
  ties or batch norm's cancellations, where stock float32 misses it too).

Dropout is switched off (every `nn.Dropout` at p = 0): fused and stock models draw
different masks.

    plait bench-fused --fidelity 10 --workload examples/transformers_workloads.py:gpt2 \\
        --n 16 --out benchmarks/hfta/hf-fidelity
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from plait.bench.fused.models import BenchModel, get_model
from plait.fused.convert import fuse
from plait.fused.losses import cross_entropy
from plait.fused.optim import FusedAdam, FusedOptimizer, FusedSGD
from plait.records import provenance, write_json, write_markdown
from plait.workloads import logits_of

#: Learning rates of the N models (model b: BASE_LR[opt] * (1 + b / N)): transformer-range
#: rates for Adam, whose float32 noise grows with the rate (see docs/guide/fused.md).
BASE_LR = {"sgd": 0.05, "adam": 1e-4}


@dataclass(frozen=True, kw_only=True)
class FidelityResult:
    """One workload and optimizer: the four distances of the module docstring."""

    workload: str
    optimizer: str
    n: int
    steps: int
    fused_vs_stock: float
    stock32_vs_stock64: float
    fused32_vs_stock64: float
    fused64_vs_stock64: float


#: A tensor is judged against at least this share of its member's largest value. BERT's
#: attention key biases have a true gradient of zero (softmax is invariant to a shift of
#: every score by the same amount): they start at zero and hold rounding noise alone, near
#: 1e-9, and noise divided by noise read O(1) (4.12 after 10 SGD steps) where every
#: tensor that training moves agreed to 1e-6.
SCALE_FLOOR = 1e-3


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor) (the absolute difference where both are 0)."""
    a, b = a.double(), b.double()
    scale = max(float(b.abs().max()) if b.numel() else 0.0, floor)
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff if scale == 0 else diff / scale


def _models(model: BenchModel, n: int, dtype: torch.dtype) -> list[nn.Module]:
    """N models of `model`, member b seeded with b, in `dtype`, dropout off."""
    out = []
    for b in range(n):
        torch.manual_seed(b)
        m = model.build().to(dtype)
        for layer in m.modules():
            if isinstance(layer, nn.Dropout):
                layer.p = 0.0
        out.append(m)
    return out


def _lrs(optimizer: str, n: int) -> list[float]:
    return [BASE_LR[optimizer] * (1 + b / n) for b in range(n)]


Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]
State = dict[str, torch.Tensor]


def _train_fused(
    model: BenchModel, n: int, optimizer: str, batches: Batches, dtype: torch.dtype
) -> list[State]:
    """The N models trained as one fused array; each member's state back as a stock
    model's state dict."""
    array = fuse(_models(model, n, dtype))
    lrs = _lrs(optimizer, n)
    opt: FusedOptimizer = (
        FusedSGD(array.parameters(), lr=lrs, momentum=0.9)
        if optimizer == "sgd"
        else FusedAdam(array.parameters(), lr=lrs)
    )
    for x, y in batches:
        opt.zero_grad()
        inputs = x.to(dtype) if x.is_floating_point() else x
        cross_entropy(logits_of(array(inputs)), y).sum().backward()
        opt.step()
    return array.to_models()


def _train_stock(
    model: BenchModel, n: int, optimizer: str, batches: Batches, dtype: torch.dtype
) -> list[State]:
    """The same N models trained one after another with torch.optim, on member b's slice
    of every batch."""
    states = []
    for b, (m, lr) in enumerate(zip(_models(model, n, dtype), _lrs(optimizer, n), strict=True)):
        opt: torch.optim.Optimizer = (
            torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
            if optimizer == "sgd"
            else torch.optim.Adam(m.parameters(), lr=lr)
        )
        for x, y in batches:
            opt.zero_grad()
            xb = x[b].to(dtype) if x.is_floating_point() else x[b]
            model.workload.loss(m(xb), y[b]).backward()
            opt.step()
        states.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    return states


def _distance(a: list[State], b: list[State]) -> float:
    """The largest relative difference of any floating-point tensor of any member, each
    tensor against at least `SCALE_FLOOR` of its member's largest value."""
    worst = 0.0
    for sa, sb in zip(a, b, strict=True):
        floats = {k: v for k, v in sb.items() if v.is_floating_point() and v.numel()}
        top = max((float(v.abs().max()) for v in floats.values()), default=0.0)
        for k, v in floats.items():
            worst = max(worst, _rel(sa[k], v, SCALE_FLOOR * top))
    return worst


def measure(
    workload: str,
    *,
    n: int,
    steps: int = 10,
    batch: int | None = None,
    optimizers: Sequence[str] = ("sgd", "adam"),
) -> list[FidelityResult]:
    """Fidelity of `workload`'s N-model array after `steps` steps of each optimizer."""
    for name in optimizers:
        if name not in BASE_LR:
            raise ValueError(f"optimizer {name!r}: choose from {', '.join(BASE_LR)}")
    model = get_model(workload)
    per_model = batch or model.batch_size
    g = torch.Generator().manual_seed(0)
    batches = [
        (model.inputs(n, per_model, g), model.targets(n, per_model, g)) for _ in range(steps)
    ]
    results = []
    for optimizer in optimizers:
        fused32 = _train_fused(model, n, optimizer, batches, torch.float32)
        stock32 = _train_stock(model, n, optimizer, batches, torch.float32)
        fused64 = _train_fused(model, n, optimizer, batches, torch.float64)
        stock64 = _train_stock(model, n, optimizer, batches, torch.float64)
        results.append(
            FidelityResult(
                workload=workload,
                optimizer=optimizer,
                n=n,
                steps=steps,
                fused_vs_stock=_distance(fused32, stock32),
                stock32_vs_stock64=_distance(stock32, stock64),
                fused32_vs_stock64=_distance(fused32, stock64),
                fused64_vs_stock64=_distance(fused64, stock64),
            )
        )
    return results


def markdown(results: Sequence[FidelityResult]) -> str:
    """The results as one Markdown table, a row per workload and optimizer."""
    lines = [
        "| workload | optimizer | N | steps | fused vs stock (fp32) | stock fp32 vs fp64 | "
        "fused fp32 vs stock fp64 | fused vs stock (fp64) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.workload} | {r.optimizer} | {r.n} | {r.steps} | {r.fused_vs_stock:.2e} | "
            f"{r.stock32_vs_stock64:.2e} | {r.fused32_vs_stock64:.2e} | "
            f"{r.fused64_vs_stock64:.2e} |"
        )
    return "\n".join(lines)


def run_fidelity(
    workloads: Sequence[str], *, sizes: Sequence[int], steps: int, batch: int | None = None
) -> list[FidelityResult]:
    """`measure` for every workload at every array size, on one thread (as the throughput
    benchmark's processes run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [
            r for w in workloads for n in sizes for r in measure(w, n=n, steps=steps, batch=batch)
        ]
    finally:
        torch.set_num_threads(threads)


def write_reports(results: Sequence[FidelityResult], out: Path) -> list[Path]:
    """``fidelity.json`` (the results and this run's provenance) and ``fidelity.md``."""
    prov = provenance()
    record = {**prov, "results": [asdict(r) for r in results]}
    head = f"# Fidelity\n\nCommand: `{prov['command']}`\n\n"
    return [
        write_json(record, out / "fidelity.json"),
        write_markdown(head + markdown(results), out / "fidelity.md"),
    ]
