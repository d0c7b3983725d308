"""A workload measured on one process of one device, as the projection needs it.

`measure_profile` times forward, backward and the optimizers' steps, the moment each
gradient is ready within backward, each K-FAC layer's factor ready times, the seconds of
each factor side's decomposition, and each strategy's own computation per step, measured
side by side in a world of one (the benchmark harness's interleaved rounds): its step
minus its compute-only step.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class Grad:
    """One trainable parameter in the order its gradient becomes ready."""

    name: str
    shape: tuple[int, ...]
    ready: float  # fraction of the backward pass done when its gradient is ready


@dataclass(frozen=True, kw_only=True)
class StrategyCost:
    """A strategy measured on one process (no peers, so no communication).

    Attributes:
        step_s: its step (with its hooks' computation: compression, K-FAC's factors).
        compute_s: its compute-only step (the benchmark's ``no_sync`` step).
    """

    step_s: float
    compute_s: float


@dataclass(kw_only=True)
class Profile:
    """A workload measured on one process of one device (`measure_profile`)."""

    workload: str
    device: str
    batch: int
    threads: int
    real: bool  # the training model and batch (the races'), else the benchmark's
    forward_s: float
    backward_s: float
    optimizer_s: dict[str, float]  # per optimizer: sgd, adamw, muon
    grads: list[Grad]
    strategies: dict[str, StrategyCost] = field(default_factory=dict)
    factor_ready: dict[str, tuple[float, float]] = field(default_factory=dict)  # layer: (A, G)
    decompose_s: dict[int, float] = field(default_factory=dict)  # factor side: seconds
    flop_s: float = 1e-10
    torch: str = ""
    commit: str = ""

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s.get("sgd", 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        d = dict(data)
        d["grads"] = [
            Grad(name=g["name"], shape=tuple(g["shape"]), ready=g["ready"]) for g in d["grads"]
        ]
        d["strategies"] = {k: StrategyCost(**v) for k, v in d.get("strategies", {}).items()}
        d["factor_ready"] = {k: (v[0], v[1]) for k, v in d.get("factor_ready", {}).items()}
        d["decompose_s"] = {int(k): float(v) for k, v in d.get("decompose_s", {}).items()}
        return cls(**d)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls.from_dict(json.loads(path.read_text()))


@contextlib.contextmanager
def _world_of_one() -> Iterator[None]:
    """A gloo group of this process alone (DDP and K-FAC need one; nothing travels)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_passes(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, repeats: int
) -> tuple[float, float, dict[str, float], dict[str, float], dict[str, float]]:
    """Median forward and backward seconds; each parameter's ready fraction of backward;
    each module's forward-end and backward-end fractions (for K-FAC's factors)."""
    device = x.device
    params = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    stamps: dict[str, float] = {}
    fwd_marks: dict[str, float] = {}

    def on_grad(p: torch.Tensor) -> None:
        stamps.setdefault(params[id(p)], time.perf_counter())

    def on_forward(name: str) -> Any:
        def hook(*_: Any) -> None:
            fwd_marks.setdefault(name, time.perf_counter())

        return hook

    handles: list[Any] = [
        p.register_post_accumulate_grad_hook(on_grad) for p in model.parameters() if p.requires_grad
    ]
    handles += [m.register_forward_hook(on_forward(n)) for n, m in model.named_modules() if n]
    fwd, bwd = [], []
    ready: dict[str, list[float]] = {}
    fready: dict[str, list[float]] = {}
    try:
        for i in range(repeats + 1):
            stamps.clear()
            fwd_marks.clear()
            model.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            loss = loss_fn(model(x), y)
            _sync(device)
            t1 = time.perf_counter()
            loss.backward()
            _sync(device)
            t2 = time.perf_counter()
            if i == 0:
                continue  # warm-up
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            for n, t in stamps.items():
                ready.setdefault(n, []).append(min(1.0, max(0.0, (t - t1) / max(t2 - t1, 1e-9))))
            for n, t in fwd_marks.items():
                fready.setdefault(n, []).append(min(1.0, (t - t0) / max(t1 - t0, 1e-9)))
    finally:
        for h in handles:
            h.remove()
    grads = {n: statistics.median(v) for n, v in ready.items()}
    fmarks = {n: statistics.median(v) for n, v in fready.items()}
    return statistics.median(fwd), statistics.median(bwd), grads, fmarks, {}


def _time_optimizers(model: nn.Module, repeats: int) -> dict[str, float]:
    from plait.train.loop import build_optimizer

    out = {}
    device = next(model.parameters()).device
    for name in ("sgd", "adamw", "muon"):
        work = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
        for w in work:
            w.grad = torch.randn_like(w)
        opt = build_optimizer(name, work, lr=1e-3)
        times = []
        for i in range(repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def _time_decompositions(model: nn.Module, device: torch.device) -> tuple[dict[int, float], float]:
    """Seconds of one decomposition per distinct factor side of `model`'s K-FAC layers
    (the inverse method, damped), and seconds per matmul flop."""
    from plait.kfac.factors import Method, decompose
    from plait.kfac.layers import FactorShape
    from plait.kfac.preconditioner import select_layers

    sides = set()
    for layer in select_layers(model).layers.values():
        for shape in (layer.a_shape, layer.g_shape):
            if not shape.diagonal:
                sides.add(shape.dim)
    out = {}
    for n in sorted(sides):
        x = torch.randn(n, n, device=device, generator=None)
        spd = x @ x.T / n + torch.eye(n, device=device)
        shape = FactorShape(dim=n)
        times = []
        for i in range(3):
            _sync(device)
            t0 = time.perf_counter()
            decompose(spd, shape, method=Method.INVERSE, damping=1e-3, packed=False)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        out[n] = min(times)
    a = torch.randn(512, 512, device=device)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    _sync(device)
    return out, max((time.perf_counter() - t0) / 5 / (2 * 512**3), 1e-14)


def measure_profile(
    workload: str,
    strategies: Sequence[str] = (),
    *,
    batch_size: int | None = None,
    device: str = "cpu",
    threads: int = 1,
    steps: int = 5,
    warmup: int = 2,
    real: bool = False,
) -> Profile:
    """Measure `workload` on this process (see the module docstring).

    `strategies` are measured side by side in a world of one (the benchmark harness's
    interleaved rounds, `plait.bench.harness`), so each one's own computation per step
    is its step minus its compute-only step. `real` profiles the training model and batch
    (the races'), otherwise the benchmark ones (``plait bench``'s).
    """
    from plait.bench.harness import BenchSpec, run_benchmark
    from plait.records import git_commit
    from plait.train.loop import seed_everything
    from plait.workloads import get_workload

    wl = get_workload(workload)
    torch.set_num_threads(threads)
    dev = torch.device(device)
    batch = batch_size or (wl.train_batch if real else wl.bench_batch)
    data = wl.real() if real else wl.bench_data(max(batch, 8))
    seed_everything(0)
    model = wl.model(data.info, bench=not real).to(dev)
    xs, ys = zip(*[data.train[i] for i in range(batch)], strict=True)
    x, y = torch.stack(list(xs)).to(dev), torch.stack(list(ys)).to(dev)
    fwd, bwd, ready, fmarks, _ = _time_passes(model, x, y, wl.loss, repeats=steps)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = sorted(
        (Grad(name=n, shape=tuple(p.shape), ready=ready.get(n, 1.0)) for n, p in named),
        key=lambda g: g.ready,
    )
    from plait.kfac.preconditioner import select_layers

    factor_ready = {}
    for name in select_layers(model).layers:
        weight = f"{name}.weight" if name else "weight"
        factor_ready[name] = (fmarks.get(name, 1.0), ready.get(weight, 1.0))
    decomp, flop_s = _time_decompositions(model, dev)
    costs: dict[str, StrategyCost] = {}
    if strategies:
        with _world_of_one():
            spec = BenchSpec(
                workload=workload,
                strategies=list(strategies),
                steps=steps,
                warmup=warmup,
                batch_size=batch,
                probe=False,
                real=real,
            )
            for rec in run_benchmark(spec):
                costs[rec.strategy_spec] = StrategyCost(
                    step_s=rec.iter_time_s, compute_s=rec.compute_time_s
                )
    return Profile(
        workload=workload,
        device=str(dev),
        batch=batch,
        threads=threads,
        real=real,
        forward_s=fwd,
        backward_s=bwd,
        optimizer_s=_time_optimizers(model, steps),
        grads=grads,
        strategies=costs,
        factor_ready=factor_ready,
        decompose_s=decomp,
        flop_s=flop_s,
        torch=torch.__version__,
        commit=git_commit(),
    )
