"""One step of a strategy simulated on `world` workers over a link (see the package).

Buckets and their bytes come from the code that plans them in a job (`plait.comm.fusion`
with the compressor's payload sizes, K-FAC's factor planners and `plan_placement`); times
from the profile and the alpha-beta model; one wire per worker.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.bench.project.profile import Grad, Profile
from plait.comm import AlphaBeta, Collective
from plait.comm.cost import Algorithms, wire_bytes_as
from plait.comm.fusion import (
    DDP_DEFAULT_BUCKET_MB,
    DDP_DEFAULT_FINAL_BUCKET_MB,
    FusionItem,
    ReadyTimePlanner,
    ThresholdPlanner,
)
from plait.specs import parse_spec

#: Kinds of strategy the projection models as K-FAC over a data-parallel strategy.
KFAC_PRESETS = ("kfac-naive", "kfac-static", "spd-kfac")


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

    `host_s_per_byte` is the host CPU a float32 byte on the wire costs where the collectives
    run on the cores that compute (gloo on the emulated cluster); `host_s` sums it. gloo
    sums on the CPU element by element, at about the same time per element in float16 as
    in float32 (7.6 against 7.2 ns at 4 ranks here; bfloat16 5.5 ns), so a payload of
    narrower elements costs the host per element, not per byte: priced per byte, ``fp16``
    was projected 20% fast at 4 nodes and 1 Gbit/s.
    """

    def __init__(
        self, link: AlphaBeta, algorithms: Algorithms, world: int, host_s_per_byte: float = 0.0
    ) -> None:
        self.link, self.algorithms, self.world = link, algorithms, world
        self.host_s_per_byte = host_s_per_byte
        self.free = 0.0
        self.busy = 0.0
        self.host_s = 0.0

    def send(self, op: Collective, nbytes: float, at: float, *, itemsize: int = 4) -> float:
        """Send `nbytes` of elements of `itemsize` bytes from `at`; when the wire is free."""
        cost = self.link.time_as(self.algorithms, op, nbytes, self.world)
        self.free = max(at, self.free) + cost
        self.busy += cost
        sent = wire_bytes_as(self.algorithms, op, nbytes, self.world)
        self.host_s += self.host_s_per_byte * sent * 4.0 / itemsize
        return self.free


def compressor(spec: str) -> Any:
    """The compressor a data-parallel spec names (its payload sizes and collectives)."""
    from plait.dp import make_compressor

    return make_compressor(spec)


def grad_buckets(profile: Profile, spec: str) -> tuple[list[list[Grad]], list[list[float]], Any]:
    """DDP's buckets of the strategy (in ready order) as `plait.dp.data_parallel` plans them,
    and each bucket's per-parameter wire bytes."""
    comp = compressor(spec)
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
    speed: float = 1.0,
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
        speed: how many times faster than the profile's device the target computes (its
            compute divided by this; 1 keeps it).
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
            speed=speed,
        )
    cost = profile.strategies.get(profile_key(spec))
    opt_s = profile.optimizer_s.get(optimizer, profile.optimizer_s["sgd"])
    passes = profile.forward_s + profile.backward_s
    # the compute-only step is forward, backward and the optimizer: the target's one (its
    # contention included) fixes the scale; without one, the profile's own
    own = passes + opt_s if cost is None else cost.compute_s - profile.optimizer_s["sgd"] + opt_s
    k = (compute_s if compute_s is not None else own / speed) / (passes + opt_s)
    f, b, o = k * profile.forward_s, k * profile.backward_s, k * opt_s
    # the strategy's own computation (compression) scales with its compute-only step
    hook_total = 0.0 if cost is None else max(0.0, cost.step_s - cost.compute_s)
    hook_total *= k * (passes + opt_s) / max(own, 1e-12)
    own_compute = k * (passes + opt_s)
    buckets, wires, comp = grad_buckets(profile, spec)
    dense_total = sum(4.0 * math.prod(g.shape) for g in profile.grads)
    wire = _Wire(link, algorithms, world, host_s_per_byte)
    itemsize = _itemsize(comp)
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
                issue = wire.send(op, nbytes, issue, itemsize=itemsize)
            sent += nbytes
        shift += wire.host_s - host  # the collective's host work delays the compute
    backward_end = f + b + shift
    step = max(backward_end, wire.free) + o
    comp.close()
    return StepEstimate(
        strategy=spec,
        world=world,
        step_s=step,
        compute_s=own_compute,
        wire_s=wire.busy,
        exposed_s=step - own_compute,
        bytes_per_step=sent,
    )


def _itemsize(comp: Any) -> int:
    """Bytes per element of a compressor's payload (a cast's wire type; float32 else)."""
    return int(getattr(comp, "wire_dtype", torch.float32).itemsize)


def kfac_layers(profile: Profile) -> Any:
    """K-FAC's layers of the profiled model (`plait.kfac.preconditioner.select_layers`)."""
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
    speed: float = 1.0,
) -> StepEstimate:
    """K-FAC over S-SGD: see the module docstring; intervals of 1 (every step computes
    factors and inverts), or amortised over `inv_interval` and `factor_interval`."""
    from dataclasses import fields, replace

    from plait.kfac.config import KFACConfig
    from plait.kfac.costs import KFACCosts
    from plait.kfac.factors import second_order_numel
    from plait.kfac.layers import FactorKind
    from plait.kfac.pipeline import FactorComm
    from plait.kfac.placement import (
        LOCAL,
        Distribution,
        PlacementPolicy,
        factor_key,
        plan_placement,
    )
    from plait.train.strategies.kfac import PRESETS, KFACPreset

    name, options = parse_spec(spec)
    config = {f.name for f in fields(KFACConfig)}
    chosen: dict[str, Any] = {k: v for k, v in options.items() if k in config}
    cfg = replace(PRESETS[KFACPreset(name)], **chosen)
    comp_opts = {k: v for k, v in options.items() if k not in config and k != "compression"}
    grad_spec = str(options.get("compression", "ssgd")) + (
        ":" + ",".join(f"{k}={v}" for k, v in comp_opts.items()) if comp_opts else ""
    )
    inv_every = cfg.inv_every if isinstance(cfg.inv_every, int) else 1
    layers = layers if layers is not None else kfac_layers(profile)
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
    method = cfg.decomposition
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
        policy=PlacementPolicy(cfg.placement),
        distribution=Distribution(cfg.distribution),
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
    fac_every = cfg.factor_every if isinstance(cfg.factor_every, int) else 1
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
        return float((passes if factors else plain_passes) + (mine if invert else 0.0) + tail)

    measured_kind = (True, True) if inv_every == 1 else (False, fac_every == 1)
    k = _scale(profile, compute_s, own(*measured_kind)) / speed
    compute = k * sum(c * own(i, fa) for i, fa, c in kinds) / inv_every
    tail *= k
    plain = profile.forward_s + profile.backward_s

    def fbytes(n: str, kind: FactorKind) -> float:
        shape = layers[n].shape(kind)
        return 4.0 * float(shape.packed_numel if packed else shape.dense_numel)

    def result_bytes(n: str, kind: FactorKind) -> float:
        return 4.0 * second_order_numel(method, layers[n].shape(kind), packed=packed)

    def one_step(invert: bool, factors: bool) -> tuple[float, float, float]:
        """(step end, wire busy, bytes) of a step of that kind."""
        work = passes if factors else plain_passes
        f = k * work * profile.forward_s / plain
        b = k * work * profile.backward_s / plain
        wire = _Wire(link, algorithms, world, host_s_per_byte)
        buckets, wires, comp = grad_buckets(profile, grad_spec)
        queue: list[tuple[float, int, float, list[tuple[str, FactorKind]]]] = [
            (f + b * max(g.ready for g in bk), 0, nbytes, [])
            for bk, ws in zip(buckets, wires, strict=True)
            for _, nbytes in _collectives_of(comp, bk, ws)
        ]
        grad_itemsize = _itemsize(comp)  # the factors' are float32 (`fbytes`)
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
        # The host's work for a collective (gloo on the computing cores) delays the passes
        # when it runs beside them; after backward the cores only wait for the wire, which
        # drains slower than they send (every link here is below the host's 5.5 Gbit/s), so
        # there it hides in the wire's time. Adding it there too priced the GPT's K-FAC
        # steps 18-26% too slow at 1 and 5 Gbit/s (benchmarks/projection/check-kfac).
        during = 0.0
        for at, kind, nbytes, keys in sorted(queue, key=lambda q: (q[0], q[1])):
            host = wire.host_s
            size = grad_itemsize if kind == 0 else 4
            end = wire.send(Collective.ALL_REDUCE, nbytes, at, itemsize=size) if world > 1 else at
            if at < f + b:
                during += wire.host_s - host
            sent += nbytes
            for key in keys:
                landed[key] = end
        backward_end = f + b + during
        comm_end = max(wire.free, backward_end)
        if not invert:
            return comm_end + tail, wire.busy, sent
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
        return max(wire.free, inv_end) + tail, wire.busy, sent

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
        compute_s=compute,
        wire_s=busy,
        exposed_s=step - compute,
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


#: K-FAC's "auto" intervals, for a projection: the GPT race's rule decided factor and
#: inversion intervals of 3 at `slow` and 3-14 over its runs (benchmarks/RESULTS.md).
AUTO_INTERVAL = 3


def projectable(spec: str) -> str:
    """`spec` with what the projection cannot price fixed: K-FAC's automatic intervals
    become `AUTO_INTERVAL`; options of the K-FAC math that change no byte or step dropped
    (damping, clipping); the approximation (it changes the factors' computation), the
    gradient compressor and its options kept."""
    from dataclasses import fields

    from plait.kfac.config import KFACConfig

    name, options = parse_spec(spec)
    if name not in KFAC_PRESETS:
        return spec
    config = {f.name for f in fields(KFACConfig)}
    mechanics = {"packed", "comm", "sync", "placement", "distribution", "overlap"}
    # the approximation changes the factors' computation, which the profile measured
    mechanics |= {"local_inversion", "bucket_cap_mb", "approximation"}
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
