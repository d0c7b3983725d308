"""Projection of step time and time to target to clusters this host cannot hold.

This host emulates 2-4 nodes; the papers ran 8-64 GPUs on 1-100 Gb/s links. The projection
carries what is measured here to those sizes with the alpha-beta model:

- a `Profile` of the workload, measured on one process of a device (`measure_profile`):
  forward, backward and optimizer time, each gradient's ready time within backward, each
  strategy's own computation per step (a step without peers minus its compute-only step:
  compression, K-FAC's factors), the seconds of each K-FAC factor's decomposition;
- the bytes of every collective of a step, from the same code that plans them in a job:
  DDP's buckets (`plait.comm.fusion`, with the compressor's payload sizes), K-FAC's factor
  buckets and the placement of its inversions (`plait.kfac.placement`);
- a link: the alpha-beta model of a rate (`plait.comm.link.link_model`), priced with the
  backend's algorithms (gloo's on the emulated cluster, the ring algorithms NCCL uses on a
  GPU cluster).

`project` simulates one step of a strategy on `world` workers: forward, then backward
releasing gradient buckets at their ready times onto one wire per worker (each transfer
starts when it is issued and the wire is free, so communication overlaps the backward pass
as it does in DDP), compression on the compute path before its bucket leaves (it competes
with backward for the device; Power-SGD's two all-reduces one after the other), K-FAC's
factor all-reduces after backward (``kfac-naive``), in threshold buckets (``kfac-static``)
or ready-time buckets (``spd-kfac``) sharing that wire, the inversions of the slowest
worker once their factors landed, the broadcast of their results, and the preconditioning
and optimizer step. `cluster_map` and `recommend` multiply a step by the steps to a target
measured in the races (``benchmarks/race``).

Compute measured on one process is the compute of a node with that device to itself. On
the emulated cluster the nodes share two cores, so `validate` scales the profile's compute
by the ratio of each measured compute-only step to the profile's (the nodes' contention,
measured in the same run), and checks the predicted step against the measured one.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.comm import AlphaBeta, Collective
from plait.comm.cost import Algorithms, wire_bytes_as
from plait.comm.fusion import (
    DDP_DEFAULT_BUCKET_MB,
    DDP_DEFAULT_FINAL_BUCKET_MB,
    FusionItem,
    ReadyTimePlanner,
    ThresholdPlanner,
)
from plait.comm.link import link_model
from plait.specs import parse_spec

#: Kinds of strategy the projection models.
KFAC_PRESETS = ("kfac-naive", "kfac-static", "spd-kfac")


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


# ---------------------------------------------------------------------------- measuring
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


# ---------------------------------------------------------------------------- the model
@dataclass(frozen=True, kw_only=True)
class Transfer:
    """One collective on the wire: what it is, how big, and when its data is ready."""

    name: str
    op: Collective
    nbytes: float
    ready_s: float


@dataclass(kw_only=True)
class StepEstimate:
    """A predicted step and its parts (seconds)."""

    strategy: str
    world: int
    step_s: float
    compute_s: float
    wire_s: float  # the link's busy time in the step
    exposed_s: float  # step minus compute: communication and waiting not hidden
    bytes_per_step: float  # payload handed to collectives by a worker
    notes: list[str] = field(default_factory=list)


class _Wire:
    """One worker's outgoing link: transfers in issue order, one at a time.

    `host_s_per_byte` is the host CPU a byte on the wire costs where the collectives run on
    the cores that compute (gloo on the emulated cluster); `host_s` sums it.
    """

    def __init__(
        self, link: AlphaBeta, algorithms: Algorithms, world: int, host_s_per_byte: float = 0.0
    ) -> None:
        self.link, self.algorithms, self.world = link, algorithms, world
        self.host_s_per_byte = host_s_per_byte
        self.free = 0.0
        self.busy = 0.0
        self.host_s = 0.0

    def send(self, op: Collective, nbytes: float, at: float) -> float:
        cost = self.link.time_as(self.algorithms, op, nbytes, self.world)
        self.free = max(at, self.free) + cost
        self.busy += cost
        self.host_s += self.host_s_per_byte * wire_bytes_as(self.algorithms, op, nbytes, self.world)
        return self.free


def _compressor(spec: str) -> Any:
    from plait.dp import make_compressor

    return make_compressor(spec)


def _grad_buckets(profile: Profile, spec: str) -> tuple[list[list[Grad]], list[list[float]], Any]:
    """DDP's buckets of the strategy (in ready order) as `plait.dp.data_parallel` plans them,
    and each bucket's per-parameter wire bytes."""
    comp = _compressor(spec)
    metas = [torch.empty(g.shape, device="meta") for g in profile.grads]
    wire = [comp.payload_nbytes(g.name, t) for g, t in zip(profile.grads, metas, strict=True)]
    dense = [4.0 * math.prod(g.shape) for g in profile.grads]
    if comp.single_bucket:
        return [list(profile.grads)], [wire], comp
    ratio = sum(wire) / max(sum(dense), 1.0)
    planner = ThresholdPlanner(
        threshold_bytes=int(DDP_DEFAULT_BUCKET_MB * 2**20),
        final_bytes=int(DDP_DEFAULT_FINAL_BUCKET_MB * 2**20),
    ).scaled(ratio)
    items = [
        FusionItem(name=g.name, nbytes=math.ceil(w))
        for g, w in zip(profile.grads, wire, strict=True)
    ]
    plan = planner.plan(items)
    return (
        [[profile.grads[i] for i in b] for b in plan],
        [[wire[i] for i in b] for b in plan],
        comp,
    )


def _collectives_of(
    comp: Any, bucket: list[Grad], wire: list[float]
) -> list[tuple[Collective, float]]:
    """The collectives one bucket's hook issues, in order, with their payloads."""
    name = getattr(comp, "name", "")
    op = next(iter(comp.collectives)) if len(comp.collectives) == 1 else Collective.ALL_REDUCE
    if name == "powersgd":  # P, then Q after orthogonalising: two all-reduces per bucket
        from plait.dp.compress.lowrank import matrix_shape

        p_bytes = q_bytes = 0.0
        for g, w in zip(bucket, wire, strict=True):
            r = comp.policy.rank_for(g.name, torch.Size(g.shape))
            if r == 0:
                p_bytes += w
                continue
            n, m = matrix_shape(torch.Size(g.shape))
            p_bytes += 4.0 * n * r
            q_bytes += 4.0 * m * r
        return [(Collective.ALL_REDUCE, p_bytes), (Collective.ALL_REDUCE, q_bytes)]
    if name == "torch-powersgd":  # torch's hook: P then Q, about half the payload each
        return [(Collective.ALL_REDUCE, sum(wire) / 2), (Collective.ALL_REDUCE, sum(wire) / 2)]
    return [(op, sum(wire))]


def _scale(profile: Profile, compute_s: float | None, base_s: float) -> float:
    """The factor that turns the profile's compute into the target's (1 without one)."""
    return 1.0 if compute_s is None else compute_s / max(base_s, 1e-12)


def project(
    profile: Profile,
    spec: str,
    *,
    world: int,
    link: AlphaBeta,
    algorithms: Algorithms = Algorithms.RING,
    compute_s: float | None = None,
    optimizer: str = "sgd",
    layers: Any = None,
    host_s_per_byte: float = 0.0,
) -> StepEstimate:
    """Predict one step of strategy `spec` on `world` workers over `link`.

    Args:
        profile: the workload measured on one process (`measure_profile`, with `spec`
            among its strategies unless it is plain ``ssgd``).
        compute_s: the compute-only step of `spec` measured on the target (the emulated
            cluster's, under its contention); None keeps the profile's compute.
        optimizer: the optimizer whose step the profile timed (sgd, adamw, muon).
        layers: K-FAC's layers of the workload's model (`plait.kfac.preconditioner.
            select_layers`); built from the workload when None.
        host_s_per_byte: host CPU seconds per byte sent, on the compute path: the cost of
            collectives that run on the computing cores (gloo on the emulated cluster's
            shared cores, `host_cost`); 0 where a NIC and NCCL move the bytes.
    """
    name, _ = parse_spec(spec)
    if name in KFAC_PRESETS:
        return _project_kfac(
            profile,
            spec,
            world=world,
            link=link,
            algorithms=algorithms,
            compute_s=compute_s,
            optimizer=optimizer,
            layers=layers,
            host_s_per_byte=host_s_per_byte,
        )
    cost = profile.strategies.get(profile_key(spec))
    opt_s = profile.optimizer_s.get(optimizer, profile.optimizer_s["sgd"])
    sgd_s = profile.optimizer_s["sgd"]  # the step the profile's strategies were timed with
    base = profile.forward_s + profile.backward_s + sgd_s
    own_compute = (base if cost is None else cost.compute_s) - sgd_s + opt_s
    hook_total = 0.0 if cost is None else max(0.0, cost.step_s - cost.compute_s)
    k = _scale(profile, compute_s, own_compute)
    f, b, o = k * profile.forward_s, k * profile.backward_s, k * opt_s
    hook_total *= k
    buckets, wires, comp = _grad_buckets(profile, spec)
    dense_total = sum(4.0 * math.prod(g.shape) for g in profile.grads)
    wire = _Wire(link, algorithms, world, host_s_per_byte)
    shift = 0.0
    sent = 0.0
    for bucket, ws in zip(buckets, wires, strict=True):
        ready = f + b * max(g.ready for g in bucket) + shift
        share = sum(4.0 * math.prod(g.shape) for g in bucket) / max(dense_total, 1.0)
        h = hook_total * share
        # compression competes with backward for the device (a GPU stream, or cores the
        # emulated nodes already fill), so its time is on the compute path; the bucket's
        # collectives leave after it, Power-SGD's two one after the other
        shift += h
        issue = ready + h
        host = wire.host_s
        for op, nbytes in _collectives_of(comp, bucket, ws):
            if world > 1:
                issue = wire.send(op, nbytes, issue)
            sent += nbytes
        shift += wire.host_s - host  # the collective's host work delays the compute
    backward_end = f + b + shift
    step = max(backward_end, wire.free) + o
    comp.close()
    return StepEstimate(
        strategy=spec,
        world=world,
        step_s=step,
        compute_s=k * own_compute,
        wire_s=wire.busy,
        exposed_s=step - k * own_compute,
        bytes_per_step=sent,
    )


def _kfac_layers(profile: Profile) -> Any:
    from plait.kfac.preconditioner import select_layers
    from plait.workloads import get_workload

    wl = get_workload(profile.workload)
    torch.manual_seed(0)
    info = wl.real().info if profile.real else wl.bench_data(8).info
    return select_layers(wl.model(info, bench=not profile.real)).layers


def _project_kfac(
    profile: Profile,
    spec: str,
    *,
    world: int,
    link: AlphaBeta,
    algorithms: Algorithms,
    compute_s: float | None,
    optimizer: str,
    layers: Any,
    host_s_per_byte: float = 0.0,
) -> StepEstimate:
    """K-FAC over S-SGD: see the module docstring; intervals of 1 (every step computes
    factors and inverts), or amortised over `inv_interval` and `factor_interval`."""
    from dataclasses import fields, replace

    from plait.kfac.config import KFACConfig
    from plait.kfac.costs import KFACCosts
    from plait.kfac.factors import Method, second_order_numel
    from plait.kfac.layers import FactorKind
    from plait.kfac.pipeline import FactorComm
    from plait.kfac.placement import LOCAL, Distribution, factor_key, plan_placement
    from plait.train.strategies.kfac import PRESETS, KFACPreset

    name, options = parse_spec(spec)
    config = {f.name for f in fields(KFACConfig)}
    cfg = replace(PRESETS[KFACPreset(name)], **{k: v for k, v in options.items() if k in config})
    comp_opts = {k: v for k, v in options.items() if k not in config and k != "compression"}
    grad_spec = str(options.get("compression", "ssgd")) + (
        ":" + ",".join(f"{k}={v}" for k, v in comp_opts.items()) if comp_opts else ""
    )
    inv_every = cfg.inv_interval if isinstance(cfg.inv_interval, int) else 1
    layers = layers if layers is not None else _kfac_layers(profile)
    names = list(layers)
    cost = profile.strategies.get(profile_key(spec))
    if cost is None:
        raise ValueError(
            f"the profile of {profile.workload} did not measure {profile_key(spec)!r} "
            f"(for {spec!r})"
        )
    opt_s = profile.optimizer_s.get(optimizer, profile.optimizer_s["sgd"])

    def decomp(dim: int, diagonal: bool) -> float:
        if diagonal:
            return 0.0
        if dim in profile.decompose_s:
            return profile.decompose_s[dim]
        near = min(profile.decompose_s, key=lambda d: abs(d - dim))
        return profile.decompose_s[near] * (dim / near) ** 3

    fac_s = {
        (n, kind): decomp(layers[n].shape(kind).dim, layers[n].shape(kind).diagonal)
        for n in names
        for kind in (FactorKind.A, FactorKind.G)
    }
    all_inv = sum(fac_s.values())
    packed = bool(cfg.packed)
    method = Method(cfg.method)
    costs = KFACCosts(
        link=link,
        inverse_s_per_n3=max(
            statistics.median(s / d**3 for d, s in profile.decompose_s.items())
            if profile.decompose_s
            else 1e-10,
            1e-15,
        ),
        flop_s=profile.flop_s,
    )
    place = plan_placement(
        list(layers.values()),
        world=world,
        costs=costs,
        method=method,
        packed=packed,
        policy=cfg.placement,
        distribution=cfg.distribution,
        local_inversion=cfg.local_inversion,
        inv_interval=inv_every,
    )
    asg = place.assignment
    loads = [0.0] * world
    owner: dict[tuple[str, FactorKind], int] = {}
    for (n, kind), s in fac_s.items():
        r = asg.inv_rank.get(factor_key(n, kind), LOCAL)
        owner[n, kind] = r
        if r == LOCAL:  # every worker inverts it itself
            loads = [x + s for x in loads]
        else:
            loads[r] += s
    slowest = max(range(world), key=lambda i: loads[i])
    mine = loads[slowest]
    lazy = str(cfg.sync) == "lazy"
    fac_every = cfg.factor_interval if isinstance(cfg.factor_interval, int) else 1
    # the one-process step's compute splits into the passes (with the factors), every
    # inversion (a world of one inverts them all), and preconditioning plus the optimizer
    precond = _precondition_s(layers, profile.flop_s)
    sgd_s = profile.optimizer_s["sgd"]
    passes = max(cost.compute_s - all_inv - precond - sgd_s, 0.0)
    plain_passes = min(passes, profile.forward_s + profile.backward_s)
    mem_opt = place.distribution is Distribution.MEM_OPT
    tail = opt_s + (precond / world if mem_opt else precond)
    # per inv_every steps: one inverts (with factors), factor steps, plain steps
    n_factor = max(inv_every // fac_every - 1, 0)
    n_plain = inv_every - 1 - n_factor
    kinds = [(True, True, 1), (False, True, n_factor), (False, False, n_plain)]

    def own(invert: bool, factors: bool) -> float:
        return (passes if factors else plain_passes) + (mine if invert else 0.0) + tail

    measured_kind = (True, True) if inv_every == 1 else (False, fac_every == 1)
    k = _scale(profile, compute_s, own(*measured_kind))
    tail *= k
    plain = profile.forward_s + profile.backward_s

    def fbytes(n: str, kind: FactorKind) -> float:
        shape = layers[n].shape(kind)
        return 4.0 * (shape.packed_numel if packed else shape.dense_numel)

    def result_bytes(n: str, kind: FactorKind) -> float:
        return 4.0 * second_order_numel(method, layers[n].shape(kind), packed=packed)

    def one_step(invert: bool, factors: bool) -> tuple[float, float, float]:
        """(step end, wire busy, bytes) of a step of that kind."""
        work = passes if factors else plain_passes
        f = k * work * profile.forward_s / plain
        b = k * work * profile.backward_s / plain
        wire = _Wire(link, algorithms, world, host_s_per_byte)
        buckets, wires, comp = _grad_buckets(profile, grad_spec)
        queue: list[tuple[float, int, float, list[tuple[str, FactorKind]]]] = [
            (f + b * max(g.ready for g in bk), 0, nbytes, [])
            for bk, ws in zip(buckets, wires, strict=True)
            for _, nbytes in _collectives_of(comp, bk, ws)
        ]
        comp.close()
        items = []
        for n in names:
            a_at, g_at = profile.factor_ready.get(n, (1.0, 1.0))
            items.append(((n, FactorKind.A), f * a_at))
            items.append(((n, FactorKind.G), f + b * g_at))
        items.sort(key=lambda t: t[1])
        if factors and (invert or not lazy) and world > 1:
            if cfg.comm is FactorComm.AFTER_BACKWARD:
                queue += [(f + b, 1, fbytes(*key), [key]) for key, _ in items]
            else:
                fi = [
                    FusionItem(name=str(i), nbytes=int(fbytes(*key)), ready_s=at)
                    for i, (key, at) in enumerate(items)
                ]
                planner: Any = (
                    ThresholdPlanner(threshold_bytes=int(cfg.bucket_cap_mb * 1e6))
                    if cfg.comm is FactorComm.STATIC
                    else ReadyTimePlanner(cost=link, world=world)
                )
                for bk in planner.plan(fi):
                    at = max(items[i][1] for i in bk)
                    nbytes = sum(fbytes(*items[i][0]) for i in bk)
                    queue.append((at, 1, nbytes, [items[i][0] for i in bk]))
        landed: dict[tuple[str, FactorKind], float] = {}
        sent = 0.0
        during = 0.0  # host work of collectives issued while the passes run delays them
        for at, _, nbytes, keys in sorted(queue, key=lambda q: (q[0], q[1])):
            host = wire.host_s
            end = wire.send(Collective.ALL_REDUCE, nbytes, at) if world > 1 else at
            if at < f + b:
                during += wire.host_s - host
            sent += nbytes
            for key in keys:
                landed[key] = end
        backward_end = f + b + during
        comm_end = max(wire.free, backward_end)
        if not invert:
            return comm_end + tail + (wire.host_s - during), wire.busy, sent
        # the slowest worker's inversions: each once its factor landed (overlap), or all
        # after the last factor landed; then every result is broadcast by its owner
        # (comm-opt), or every layer's preconditioned gradient by its owner (mem-opt)
        todo = sorted(
            (landed.get(key, backward_end), k * s)
            for key, s in fac_s.items()
            if owner[key] in (slowest, LOCAL)
        )
        t = backward_end if cfg.overlap else comm_end
        for land, s in todo:
            t = (max(t, land) if cfg.overlap else t) + s
        inv_end = max(t, comm_end)
        if world > 1:
            if mem_opt:
                out = [4.0 * layers[n].grad_numel for n in names]
            else:
                out = [result_bytes(*key) for key in fac_s if owner[key] != LOCAL]
            for nbytes in out:
                wire.send(Collective.BROADCAST, nbytes, inv_end)
                sent += nbytes
        return max(wire.free, inv_end) + (wire.host_s - during) + tail, wire.busy, sent

    total = [0.0, 0.0, 0.0]
    for invert, factors, count in kinds:
        if count:
            step_kind = one_step(invert, factors)
            total = [t + count * x / inv_every for t, x in zip(total, step_kind, strict=True)]
    step, busy, sent = total
    return StepEstimate(
        strategy=spec,
        world=world,
        step_s=step,
        compute_s=k * sum(c * own(i, fa) for i, fa, c in kinds) / inv_every,
        wire_s=busy,
        exposed_s=step - k * sum(c * own(i, fa) for i, fa, c in kinds) / inv_every,
        bytes_per_step=sent,
        notes=[
            f"distribution {place.distribution}",
            f"slowest worker inverts {mine:.3f} s of {all_inv:.3f} s",
        ],
    )


def _precondition_s(layers: Mapping[str, Any], flop_s: float) -> float:
    """Seconds of preconditioning every layer's gradient (its matmul flops)."""
    from plait.kfac.factors import Method
    from plait.kfac.placement import precondition_flops

    return sum(flop_s * precondition_flops(layer, Method.INVERSE) for layer in layers.values())


# ---------------------------------------------------------------------------- validation
#: The projection's goal against the emulated cluster: every step within 15%.
TOLERANCE = 0.15


@dataclass(frozen=True, kw_only=True)
class Check:
    """One emulated measurement against its projection."""

    workload: str
    strategy: str
    nodes: int
    bandwidth: str
    rate: str
    measured_s: float
    compute_s: float
    predicted_s: float
    source: str

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0

    @property
    def ok(self) -> bool:
        return abs(self.error) <= TOLERANCE


def host_cost(probe: Mapping[str, Any]) -> float:
    """Host CPU seconds per wire byte of the emulated cluster's collectives, from an
    unshaped `plait cluster probe` (its largest all-reduce's bus bandwidth): where nothing
    shapes the link, gloo's reductions and the kernel's TCP path on the shared cores are
    what limits a collective, so each byte costs the cores that much time."""
    return 8.0 / float(probe["busbw_bps"][-1])


def validate(
    profiles: Mapping[str, Profile],
    records: Sequence[Mapping[str, Any]],
    *,
    source: str = "",
    host_s_per_byte: float = 0.0,
) -> list[Check]:
    """Predict every `plait bench` record of a profiled workload from its measured compute
    and its link's rate (gloo's algorithms, as the emulated cluster runs them), with the
    emulated host's CPU cost per byte sent (`host_cost`)."""
    from plait.units import parse_duration, parse_rate

    out = []
    layer_cache: dict[str, Any] = {}
    for r in records:
        profile = profiles.get(str(r["workload"]))
        if profile is None or not r.get("rate"):
            continue
        latency = r.get("latency")
        link = link_model(
            parse_rate(str(r["rate"])), latency_s=parse_duration(latency) if latency else 0.0
        )
        spec = str(r["strategy_spec"])
        layers = None
        if parse_spec(spec)[0] in KFAC_PRESETS:
            layers = layer_cache.setdefault(profile.workload, _kfac_layers(profile))
        est = project(
            profile,
            spec,
            world=int(r["world_size"]),
            link=link,
            algorithms=Algorithms.GLOO,
            compute_s=float(r["compute_time_s"]),
            layers=layers,
            host_s_per_byte=host_s_per_byte,
        )
        out.append(
            Check(
                workload=profile.workload,
                strategy=spec,
                nodes=int(r["nodes"]),
                bandwidth=str(r["bandwidth"]),
                rate=str(r["rate"]),
                measured_s=float(r["iter_time_s"]),
                compute_s=float(r["compute_time_s"]),
                predicted_s=est.step_s,
                source=source,
            )
        )
    return out


def checks_markdown(checks: Sequence[Check]) -> str:
    lines = [
        "| workload | strategy | nodes | bandwidth | compute-only s | measured s | "
        "projected s | error | within 15% |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c.workload} | {c.strategy} | {c.nodes} | {c.bandwidth} ({c.rate}) | "
            f"{c.compute_s:.3f} | {c.measured_s:.3f} | {c.predicted_s:.3f} | "
            f"{100 * c.error:+.1f}% | {'yes' if c.ok else '**no**'} |"
        )
    n_ok = sum(c.ok for c in checks)
    worst = max((abs(c.error) for c in checks), default=0.0)
    lines += ["", f"{n_ok} of {len(checks)} within 15%; largest error {100 * worst:.1f}%."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- time to target
@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A data-parallel strategy with an optimizer, and its steps to the races' target."""

    spec: str
    optimizer: str
    steps: float | None  # median steps to target over the races that measured it
    label: str

    @property
    def name(self) -> str:
        return f"{self.spec}+{self.optimizer}"


def race_candidates(races: Sequence[Path], workload: str) -> list[Candidate]:
    """Every (strategy, optimizer) the races of `workload` took to their target, with the
    median of their steps to target over those races (entries that never reached it left
    out: their time to target is unknown)."""
    seen: dict[tuple[str, str], list[float]] = {}
    for path in races:
        for r in json.loads(Path(path).read_text()):
            if r["workload"] != workload or r.get("steps_to_target") is None:
                continue
            seen.setdefault((r["spec"], r["optimizer"]), []).append(float(r["steps_to_target"]))
    return [
        Candidate(spec=s, optimizer=o, steps=statistics.median(v), label=f"{s}+{o}")
        for (s, o), v in sorted(seen.items())
    ]


#: K-FAC's "auto" intervals, for a projection: the GPT race's rule decided factor and
#: inversion intervals of 3 at `slow` and 3-14 over its runs (benchmarks/RESULTS.md).
AUTO_INTERVAL = 3


def projectable(spec: str) -> str:
    """`spec` with what the projection cannot price fixed: K-FAC's automatic intervals
    become `AUTO_INTERVAL`; options of the K-FAC math that change no byte or step dropped
    (damping, clipping, the approximation); the gradient compressor and its options kept."""
    from dataclasses import fields

    from plait.kfac.config import KFACConfig

    name, options = parse_spec(spec)
    if name not in KFAC_PRESETS:
        return spec
    config = {f.name for f in fields(KFACConfig)}
    mechanics = {"packed", "comm", "sync", "placement", "distribution", "overlap"}
    mechanics |= {"local_inversion", "bucket_cap_mb"}
    keep = {}
    for k, v in options.items():
        if k in ("factor_interval", "inv_interval"):
            keep[k] = AUTO_INTERVAL if v == "auto" else v
        elif k in mechanics or k not in config:  # the compressor and its options too
            keep[k] = v
    return name + (":" + ",".join(f"{k}={v}" for k, v in keep.items()) if keep else "")


def profile_key(spec: str) -> str:
    """The strategy a profile measures for `spec`: K-FAC at intervals of 1 (every step
    computes factors and inverts, so its one-process step splits into passes, inversions
    and a tail; the projection amortises the intervals itself), keeping the approximation,
    which changes the factors' computation."""
    name, options = parse_spec(spec)
    if name not in KFAC_PRESETS:
        return projectable(spec)
    approx = options.get("approximation")
    return name + (f":approximation={approx}" if approx else "")


@dataclass(kw_only=True)
class Cell:
    """One cluster: every candidate's step and time to target, and the winner."""

    nodes: int
    rate: str
    steps_s: dict[str, float]
    to_target_s: dict[str, float]
    winner: str


def cluster_map(
    profile: Profile,
    candidates: Sequence[Candidate],
    *,
    nodes: Sequence[int] = (8, 16, 32, 64),
    rates: Sequence[str] = ("1gbit", "10gbit", "25gbit", "100gbit"),
    algorithms: Algorithms = Algorithms.RING,
) -> list[Cell]:
    """Which candidate reaches the target first on each cluster (nodes x link rate)."""
    from plait.units import parse_rate

    layers = (
        _kfac_layers(profile)
        if any(parse_spec(c.spec)[0] in KFAC_PRESETS for c in candidates)
        else None
    )
    cells = []
    for n in nodes:
        for rate in rates:
            link = link_model(parse_rate(rate))
            steps: dict[str, float] = {}
            target: dict[str, float] = {}
            for c in candidates:
                est = project(
                    profile,
                    projectable(c.spec),
                    world=n,
                    link=link,
                    algorithms=algorithms,
                    optimizer=c.optimizer,
                    layers=layers,
                )
                steps[c.name] = est.step_s
                if c.steps is not None:
                    target[c.name] = est.step_s * c.steps
            ranked = target or steps
            cells.append(
                Cell(
                    nodes=n,
                    rate=rate,
                    steps_s=steps,
                    to_target_s=target,
                    winner=min(ranked, key=ranked.__getitem__),
                )
            )
    return cells


#: What `recommend` weighs when no race of the model is at hand: the data-parallel
#: strategies at rank 4 and SPD-KFAC, each with the workload's own optimizer.
DEFAULT_CANDIDATES = ("ssgd", "fp16", "powersgd:rank=4", "acpsgd:rank=4", "spd-kfac")


@dataclass(kw_only=True)
class Recommendation:
    """`plait plan`'s data-parallel advice: every candidate projected on one cluster."""

    workload: str
    world: int
    rate: str
    rows: list[tuple[str, float, float | None]]  # (candidate, step s, time to target s)
    by_target: bool  # ranked by time to the races' target (else by step time)

    @property
    def best(self) -> str:
        return self.rows[0][0]

    def text(self) -> str:
        what = "time to the races' target" if self.by_target else "step time (no race of it)"
        lines = [
            f"data-parallel strategy and optimizer for {self.workload} on {self.world} "
            f"node(s) at {self.rate}: {self.best} (projected, ranked by {what})",
            "",
            f"{'candidate':<60} {'step s':>9} {'to target s':>12}",
        ]
        for name, step, target in self.rows:
            t = f"{target:12.1f}" if target is not None else f"{'-':>12}"
            lines.append(f"{name:<60} {step:9.3f} {t}")
        return "\n".join(lines)


def recommend(
    workload: str,
    *,
    world: int,
    rate: str,
    races: Sequence[Path] = (),
    real: bool = False,
    optimizer: str | None = None,
) -> Recommendation:
    """Project every candidate on `world` nodes linked at `rate` (NCCL's ring algorithms)
    from a profile measured here; rank by time to the races' target where races of the
    model are given (`real`: the races train the training model), else by step time."""
    from plait.units import parse_rate
    from plait.workloads import get_workload

    wl = get_workload(workload)
    cands = race_candidates(races, workload) if real and races else []
    by_target = bool(cands)
    if not cands:
        from plait.kfac.preconditioner import select_layers

        opt = optimizer or wl.optimizer
        info = wl.real().info if real else wl.bench_data(8).info
        kfac_ok = bool(select_layers(wl.model(info, bench=not real)).layers)
        cands = [
            Candidate(spec=s, optimizer=opt, steps=None, label=s)
            for s in DEFAULT_CANDIDATES
            if kfac_ok or parse_spec(s)[0] not in KFAC_PRESETS
        ]
    specs = list(dict.fromkeys(profile_key(c.spec) for c in cands))
    prof = measure_profile(workload, specs, real=real, steps=3, warmup=1)
    link = link_model(parse_rate(rate))
    layers = _kfac_layers(prof) if any(parse_spec(s)[0] in KFAC_PRESETS for s in specs) else None
    rows: list[tuple[str, float, float | None]] = []
    for c in cands:
        est = project(
            prof, projectable(c.spec), world=world, link=link, optimizer=c.optimizer, layers=layers
        )
        rows.append((c.name, est.step_s, est.step_s * c.steps if c.steps else None))
    rows.sort(key=lambda r: r[2] if r[2] is not None else r[1])
    return Recommendation(workload=workload, world=world, rate=rate, rows=rows, by_target=by_target)


def map_markdown(cells: Sequence[Cell], *, title: str) -> str:
    rates = list(dict.fromkeys(c.rate for c in cells))
    nodes = list(dict.fromkeys(c.nodes for c in cells))
    by = {(c.nodes, c.rate): c for c in cells}
    lines = [
        f"## {title}",
        "",
        "| nodes | " + " | ".join(rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    for n in nodes:
        row = []
        for r in rates:
            c = by[n, r]
            best = c.to_target_s.get(c.winner) or c.steps_s[c.winner]
            row.append(f"**{c.winner}** {best:.2f} s")
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    lines += [
        "",
        "Step seconds of every candidate:",
        "",
        "| nodes | rate | " + " | ".join(cells[0].steps_s) + " |",
        "|---|---|" + "---|" * len(cells[0].steps_s),
    ]
    for c in cells:
        lines.append(
            f"| {c.nodes} | {c.rate} | " + " | ".join(f"{v:.3f}" for v in c.steps_s.values()) + " |"
        )
    return "\n".join(lines) + "\n"


def plot_map(cells: Sequence[Cell], path: Path, *, title: str) -> None:
    """The winner of each cluster as a coloured grid (nodes x link rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(c.rate for c in cells))
    nodes = list(dict.fromkeys(c.nodes for c in cells))
    winners = sorted({c.winner for c in cells})
    colour = {w: i for i, w in enumerate(winners)}
    grid = [
        [colour[next(c.winner for c in cells if c.nodes == n and c.rate == r)] for r in rates]
        for n in nodes
    ]
    fig, ax = plt.subplots(figsize=(1.8 * len(rates) + 2, 0.7 * len(nodes) + 2))
    ax.imshow(grid, cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for i, n in enumerate(nodes):
        for j, r in enumerate(rates):
            c = next(c for c in cells if c.nodes == n and c.rate == r)
            ax.text(j, i, c.winner.replace("+", "\n+"), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(rates)), rates)
    ax.set_yticks(range(len(nodes)), [str(n) for n in nodes])
    ax.set_xlabel("link rate per node")
    ax.set_ylabel("nodes")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.project profile|validate|map ...`` (see --help)."""
    import argparse

    from plait.records import write_json, write_markdown

    parser = argparse.ArgumentParser(prog="python -m plait.bench.project")
    sub = parser.add_subparsers(dest="action", required=True)
    pr = sub.add_parser("profile", help="measure a workload on this process")
    pr.add_argument("--workload", required=True)
    pr.add_argument("--strategies", default="", help="specs; ';' between them")
    pr.add_argument("--real", action="store_true", help="the training model (the races')")
    pr.add_argument("--device", default="cpu")
    pr.add_argument("--steps", type=int, default=5)
    pr.add_argument("--out", type=Path, required=True)
    va = sub.add_parser("validate", help="projection vs emulated `plait bench` results")
    va.add_argument("--profile", type=Path, action="append", required=True)
    va.add_argument("--results", type=Path, action="append", required=True)
    va.add_argument(
        "--host-probe",
        type=Path,
        default=None,
        help="an unshaped probe of the emulated cluster (JSON of plait cluster probe): "
        "the host's CPU cost per byte sent",
    )
    va.add_argument("--out", type=Path, required=True)
    ma = sub.add_parser("map", help="which strategy and optimizer wins where")
    ma.add_argument("--profile", type=Path, required=True)
    ma.add_argument("--races", type=Path, action="append", default=[])
    ma.add_argument("--nodes", default="8,16,32,64")
    ma.add_argument("--rates", default="1gbit,10gbit,25gbit,100gbit")
    ma.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.action == "profile":
        specs = [s for s in args.strategies.split(";") if s]
        prof = measure_profile(
            args.workload, specs, device=args.device, steps=args.steps, real=args.real
        )
        prof.save(args.out)
        print(f"wrote {args.out}")
        return 0
    if args.action == "validate":
        profiles = {p.workload: p for p in map(Profile.load, args.profile)}
        host = (
            0.0 if args.host_probe is None else host_cost(json.loads(args.host_probe.read_text()))
        )
        checks: list[Check] = []
        for path in args.results:
            recs = json.loads((path / "results.json").read_text())
            checks += validate(profiles, recs, source=str(path), host_s_per_byte=host)
        write_json(
            [{**asdict(c), "error": c.error, "ok": c.ok} for c in checks],
            args.out / "results.json",
            indent=2,
        )
        text = checks_markdown(checks)
        write_markdown(text, args.out / "results.md")
        print(text)
        return 0 if all(c.ok for c in checks) else 1
    prof = Profile.load(args.profile)
    cands = race_candidates(
        [p / "results.json" if p.is_dir() else p for p in args.races], prof.workload
    )
    if not cands:
        raise SystemExit(f"no race of {prof.workload} reached its target in {args.races}")
    cells = cluster_map(
        prof,
        cands,
        nodes=[int(n) for n in args.nodes.split(",")],
        rates=args.rates.split(","),
    )
    title = f"{prof.workload}: first to the races' target, projected (compute of {prof.device})"
    text = map_markdown(cells, title=title)
    write_markdown(text, args.out / "map.md")
    write_json([asdict(c) for c in cells], args.out / "map.json", indent=2)
    plot_map(cells, args.out / "map.png", title=title)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
