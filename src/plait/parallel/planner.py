"""The automatic planner: which plan trains this model fastest within the memory.

It enumerates the plans the world size and the model admit (every split into pipeline x
data x tensor degrees, ZeRO stages, sequence parallelism, schedules and micro-batch
counts, activation checkpointing, offload where host memory is separate), prices each with

- the memory model of `plait.parallel.memory` (activations measured on the model), which
  rejects plans that do not fit the memory per device; and
- a time model: the model's forward+backward time measured on this device, split over
  the ranks that compute it (with the pipeline bubble of the schedule, the recomputation
  of checkpointing, the work tensor parallelism replicates, and the CPU cores ranks share
  when several run on one host), plus every collective of the plan priced by the
  alpha-beta model of `plait.comm` fitted to the *measured* network,

and picks the fastest plan that fits. `Choice.table()` explains the decision: the chosen
plan and every rejected alternative with its predicted time, memory and the reason.
"""

from __future__ import annotations

import contextlib
import copy
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from plait._proc import usable_cpus
from plait.comm import AlphaBeta, Collective, CollectiveCosts
from plait.distributed import new_group
from plait.parallel.adapters import ModelDims, adapter_for
from plait.parallel.api import LossFn, cross_entropy
from plait.parallel.memory import (
    ActivationProfile,
    MemoryEstimate,
    estimate_memory,
    format_bytes,
    measure_activations,
)
from plait.parallel.plan import Plan, Schedule, ZeroStage

#: Forward share of a forward+backward pass (backward costs about twice the forward).
FORWARD_SHARE = 1 / 3


@dataclass(frozen=True, kw_only=True)
class ComputeProfile:
    """The model measured on one device.

    Attributes:
        sample_s: forward+backward seconds per sample (whole model, one rank alone).
        block_share: share of that time spent in the blocks (the rest is replicated by
            tensor parallelism and sits on the first/last pipeline stage).
        acts: activation bytes per sample.
        tp_overhead_s: host seconds tensor parallelism adds to one block's forward and
            backward (DTensor dispatch, layouts), without and with sequence parallelism,
            measured on a one-rank mesh; the collectives themselves are priced apart.
        op_overhead_s: host seconds per pipeline send and receive (schedule, point-to-point
            set-up), counted as compute.
    """

    sample_s: float
    block_share: float
    acts: ActivationProfile
    tp_overhead_s: tuple[float, float] = (0.0, 0.0)
    op_overhead_s: float = 5e-3


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the plan runs on.

    Attributes:
        world: ranks.
        network: alpha-beta models of the collectives on the network (measured by
            `plait.comm.probe.probe_collectives`; an `AlphaBeta` prices all alike).
        memory_bytes: memory per device (None: unlimited).
        slots: ranks that compute at full speed at once; below `world` when ranks share a
            host's cores (an emulated cluster), so one rank's idle time speeds up others.
        host_offload: offloaded state leaves device memory (a GPU); on a CPU it does not.
    """

    world: int
    network: CollectiveCosts | AlphaBeta
    memory_bytes: int | None = None
    slots: int | None = None
    host_offload: bool = False


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """A plan priced: predicted step time, its parts, memory, and the verdict."""

    plan: Plan
    memory: MemoryEstimate
    compute_s: float
    comm_s: dict[str, float]
    fits: bool
    reason: str = ""

    @property
    def time_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())


def _costs(network: CollectiveCosts | AlphaBeta) -> CollectiveCosts:
    return network if isinstance(network, CollectiveCosts) else CollectiveCosts(default=network)


@dataclass(kw_only=True)
class Choice:
    """The planner's decision and what it weighed."""

    plan: Plan
    estimates: list[Estimate]
    hardware: Hardware
    dims: ModelDims
    global_batch: int
    profile: ComputeProfile
    measured: dict[str, float] = field(default_factory=dict)

    @property
    def best(self) -> Estimate:
        return next(e for e in self.estimates if e.plan == self.plan)

    def table(self, *, limit: int | None = 25) -> str:
        """A Markdown table: the choice first, then alternatives by predicted time."""
        hw = self.hardware
        mem = "unlimited" if hw.memory_bytes is None else format_bytes(hw.memory_bytes)
        ar = _costs(hw.network).model(Collective.ALL_REDUCE)
        lines = [
            f"world {hw.world} (compute slots {hw.slots or hw.world}), memory per device {mem}, "
            f"network alpha {ar.alpha * 1e6:.0f} us, {ar.bandwidth_bps / 1e6:.0f} Mbit/s "
            f"(all-reduce); model {self.dims.params / 1e6:.1f} M params, {self.dims.layers} "
            f"blocks; global batch {self.global_batch}; measured "
            f"{self.profile.sample_s * 1e3:.1f} ms/sample forward+backward",
            "",
            "| | plan | predicted s/step | compute s | communication s | memory/rank "
            "| model state | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        rows = self.estimates if limit is None else self.estimates[:limit]
        for e in rows:
            mark = "**chosen**" if e.plan == self.plan else ""
            comm = ", ".join(f"{k} {v:.3f}" for k, v in e.comm_s.items() if v > 0) or "-"
            if not e.fits:
                verdict = e.reason
            elif e.plan == self.plan:
                verdict = "fits"
            else:
                verdict = f"predicted {e.time_s / self.best.time_s:.2f}x"
            if e.plan.describe() in self.measured:
                verdict += f"; trial {self.measured[e.plan.describe()]:.3f} s"
            lines.append(
                f"| {mark} | `{e.plan.describe()}` | {e.time_s:.3f} | {e.compute_s:.3f} | {comm} | "
                f"{format_bytes(e.memory.total)} | {format_bytes(e.memory.model_state)} | "
                f"{verdict} |"
            )
        if limit is not None and len(self.estimates) > limit:
            lines.append(f"| | ... {len(self.estimates) - limit} more | | | | | | |")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The decision and every estimate (JSON-ready)."""
        return {
            "plan": self.plan.describe(),
            "world": self.hardware.world,
            "slots": self.hardware.slots,
            "memory_bytes": self.hardware.memory_bytes,
            "network": _costs(self.hardware.network).to_dict(),
            "measured": self.measured,
            "global_batch": self.global_batch,
            "sample_s": self.profile.sample_s,
            "estimates": [
                {
                    "plan": e.plan.describe(),
                    "time_s": e.time_s,
                    "compute_s": e.compute_s,
                    "comm_s": e.comm_s,
                    "memory_bytes": e.memory.total,
                    "model_state_bytes": e.memory.model_state,
                    "fits": e.fits,
                    "reason": e.reason,
                }
                for e in self.estimates
            ],
        }


# ---------------------------------------------------------------- enumeration
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_plans(
    world: int, dims: ModelDims, *, global_batch: int, host_offload: bool = False
) -> Iterator[Plan]:
    """Every valid plan for this world and model (see the module docstring)."""
    for tp in _divisors(world):
        try:
            dims.check_tensor_degree(tp)
        except ValueError:
            continue
        for pp in _divisors(world // tp):
            if pp > 1 and (dims.layers < pp or dims.layers == 0):
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            local = global_batch // dp
            zeros = [ZeroStage.NONE]
            if dp > 1:
                zeros += [ZeroStage.GRADIENTS, ZeroStage.PARAMETERS]
                if tp == 1:
                    zeros.insert(1, ZeroStage.OPTIMIZER)
            sps = (
                [False, True]
                if tp > 1 and (not dims.seq_len or dims.seq_len % tp == 0)
                else [False]
            )
            schedules = [Schedule.ONE_F_ONE_B]
            if pp > 1:
                schedules = [Schedule.GPIPE, Schedule.ONE_F_ONE_B]
                if dims.layers >= 2 * pp:
                    schedules += [Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE]
            for zero in zeros:
                offloads = (
                    [False, True] if host_offload and zero >= ZeroStage.GRADIENTS else [False]
                )
                for sp in sps:
                    for schedule in schedules:
                        if schedule is Schedule.ZERO_BUBBLE and (
                            zero is ZeroStage.PARAMETERS or sp
                        ):
                            continue
                        mbs: list[int | None] = [None]
                        if pp > 1:
                            mbs = [m for m in (pp, 2 * pp, 4 * pp) if m <= local and local % m == 0]
                        for m in mbs:
                            for ac in (False, True):
                                for off in offloads:
                                    yield Plan(dp=dp, tp=tp, pp=pp, zero=zero, sp=sp,
                                               schedule=schedule, microbatches=m, ac=ac,
                                               offload=off)  # fmt: skip


# -------------------------------------------------------------------- pricing
def estimate(
    plan: Plan,
    *,
    dims: ModelDims,
    profile: ComputeProfile,
    hardware: Hardware,
    global_batch: int,
    optimizer_states: int = 2,
    bytes_per_param: int = 4,
) -> Estimate:
    """Price one resolved plan (see the module docstring)."""
    world = hardware.world
    dp, tp, pp = plan.dp or world // (plan.tp * plan.pp), plan.tp, plan.pp
    plan = plan.resolved(world) if plan.dp is None else plan
    mem = estimate_memory(
        plan, dims=dims, acts=profile.acts, global_batch=global_batch,
        optimizer_states=optimizer_states, bytes_per_param=bytes_per_param,
        offload_counts=not hardware.host_offload,
    )  # fmt: skip
    net = _costs(hardware.network)
    s = bytes_per_param
    m = plan.n_microbatches()
    local = global_batch / dp
    mb = local / m
    # ---- compute: critical path of the busiest rank vs the cores all ranks share
    block = profile.sample_s * profile.block_share
    other = profile.sample_s - block
    recompute = block * FORWARD_SHARE if plan.ac else 0.0
    stage_blocks = -(-dims.layers // plan.n_stages()) * (
        plan.schedule.stages_per_rank if pp > 1 else 1
    )
    tp_host = stage_blocks * m * profile.tp_overhead_s[plan.sp] if tp > 1 else 0.0
    rank_blocks = local * (block + recompute) / (tp * pp) + tp_host
    rank_other = local * other
    slots = hardware.slots or world
    total_work = global_batch * (block + recompute + other * tp) + tp_host * world
    comm: dict[str, float] = {}
    if pp > 1:
        chunks = m * plan.schedule.stages_per_rank
        act = mb * max(dims.seq_len, 1) * dims.hidden * s
        pipe: dict[str, Any] = {
            "work": rank_blocks + rank_other + 2 * chunks * profile.op_overhead_s,
            "pp": pp,
            "chunks": chunks,
            "busy_per_stage": world // pp,
            "slots": slots,
            "fill_discount": 1 / 3 if plan.schedule is Schedule.ZERO_BUBBLE else 1.0,
        }
        ticks = pipeline_time(**pipe)
        comm["pp"] = pipeline_time(**pipe, send_s=net.time(Collective.SEND, act, 2)) - ticks
        # no schedule beats the shared cores: a zero-bubble schedule fills its bubbles
        # with work that idle ranks' cores would have run for the busy ones anyway
        ops = world * 2 * chunks * profile.op_overhead_s
        compute = max(ticks, (total_work + ops) / slots)
    else:
        compute = max(rank_blocks + rank_other, total_work / slots)
    # ---- communication, priced on the measured network
    local_params = min(stage_blocks, dims.layers) * dims.block_params / tp + dims.other_params
    grad_bytes = local_params * s
    if dp > 1:
        if plan.zero <= ZeroStage.OPTIMIZER:
            t = net.time(Collective.ALL_REDUCE, grad_bytes, dp)
            if plan.zero is ZeroStage.OPTIMIZER:  # each owner broadcasts its updated shard
                t += net.time(Collective.BROADCAST, grad_bytes, dp)
        else:  # FSDP: gather before forward (and again before backward under ZeRO-3)
            gathers = 1 if plan.zero is ZeroStage.GRADIENTS else 2 * m
            t = net.time(Collective.REDUCE_SCATTER, grad_bytes, dp)
            t += gathers * net.time(Collective.ALL_GATHER, grad_bytes / dp, dp)
        comm["dp"] = t
    if tp > 1:
        act = mb * max(dims.seq_len, 1) * dims.hidden * s
        if plan.sp:  # per sub-layer: all-gather the sequence, reduce-scatter the output
            per_block = 4 * (
                net.time(Collective.ALL_GATHER, act / tp, tp)
                + net.time(Collective.REDUCE_SCATTER, act, tp)
            )
        else:  # per sub-layer: all-reduce the row-parallel output (and its input gradient)
            per_block = 4 * net.time(Collective.ALL_REDUCE, act, tp)
        comm["tp"] = stage_blocks * m * per_block
    fits = hardware.memory_bytes is None or mem.total <= hardware.memory_bytes
    limit = format_bytes(hardware.memory_bytes or 0)
    reason = "" if fits else f"out of memory ({format_bytes(mem.total)} > {limit})"
    return Estimate(plan=plan, memory=mem, compute_s=compute, comm_s=comm, fits=fits, reason=reason)


def pipeline_time(
    work: float,
    *,
    pp: int,
    chunks: int,
    busy_per_stage: int,
    slots: int,
    send_s: float = 0.0,
    fill_discount: float = 1.0,
) -> float:
    """Seconds for a rank's `work`, cut into `chunks`, to flow through `pp` stages.

    The schedule advances in ticks of one chunk; in tick i only the stages the pipeline
    has reached (fill) or not yet left (drain) compute. When ranks share cores (`slots`
    below the ranks computing at once), a tick with more busy ranks than slots stretches,
    and one with fewer does not: the pipeline's idle ranks lend their cores, which the
    classic bubble fraction (pp - 1) / chunks ignores. Sends overlap compute: a steady
    tick lasts at least the activation out and the gradient back (`send_s` each), and
    filling and draining the pipeline crosses every hop once each way. `fill_discount`
    scales the fill and drain ticks (zero-bubble schedules fill them with weight-gradient
    work).
    """
    t = work / chunks
    total = 2 * (pp - 1) * send_s
    for i in range(chunks + pp - 1):
        busy = min(i + 1, pp, chunks + pp - 1 - i, chunks)
        tick = max(t * max(1.0, busy * busy_per_stage / slots), 2 * send_s)
        total += tick * (fill_discount if busy < pp else 1.0)
    return total


def choose(
    *,
    dims: ModelDims,
    profile: ComputeProfile,
    hardware: Hardware,
    global_batch: int,
    optimizer_states: int = 2,
) -> Choice:
    """Price every candidate plan and pick the fastest that fits.

    Raises:
        ValueError: no plan fits in the memory per device.
    """
    estimates = [
        estimate(
            p,
            dims=dims,
            profile=profile,
            hardware=hardware,
            global_batch=global_batch,
            optimizer_states=optimizer_states,
        )
        for p in candidate_plans(
            hardware.world, dims, global_batch=global_batch, host_offload=hardware.host_offload
        )
    ]
    # fastest first; among equals the smaller footprint; plans that do not fit last
    estimates.sort(
        key=lambda e: (not e.fits, round(e.time_s, 6) if e.fits else 0.0, e.memory.total)
    )
    if not estimates or not estimates[0].fits:
        least = min((e.memory.total for e in estimates), default=0.0)
        raise ValueError(
            f"no plan fits in {format_bytes(hardware.memory_bytes or 0)} per device; the "
            f"smallest needs {format_bytes(least)}"
        )
    return Choice(plan=estimates[0].plan, estimates=estimates, hardware=hardware, dims=dims,
                  global_batch=global_batch, profile=profile)  # fmt: skip


# ------------------------------------------------------------------ measuring
def profile_model(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    loss_fn: LossFn = cross_entropy,
    repeats: int = 3,
) -> ComputeProfile:
    """Measure forward+backward time and activations of `model` on the batch `(x, y)`.

    Runs on a copy, so `model` keeps no gradients. The blocks' share of the time is timed
    with forward hooks on the forward pass (backward follows the same split).
    """
    work = copy.deepcopy(model)
    adapter = adapter_for(work)
    adapter.prepare(work)
    acts = measure_activations(work, x, y, loss_fn)
    blocks = [work.get_submodule(b) for b in adapter.blocks(work)]
    in_blocks = [0.0]
    start = [0.0]

    def pre(*_: Any) -> None:
        start[0] = time.perf_counter()

    def post(*_: Any) -> None:
        in_blocks[0] += time.perf_counter() - start[0]

    handles = [
        h for b in blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))
    ]
    fwd_total = []
    times = []
    try:
        for i in range(repeats + 1):
            in_blocks[0] = 0.0
            t0 = time.perf_counter()
            loss = loss_fn(work(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            work.zero_grad(set_to_none=True)
            if i:  # the first run warms up
                times.append(t2 - t0)
                fwd_total.append((in_blocks[0], t1 - t0))
    finally:
        for h in handles:
            h.remove()
    share = statistics.median(b / max(f, 1e-9) for b, f in fwd_total) if blocks else 0.0
    return ComputeProfile(
        sample_s=statistics.median(times) / x.shape[0],
        block_share=share,
        acts=acts,
        tp_overhead_s=tensor_parallel_overhead(work, x, repeats=repeats),
    )


def tensor_parallel_overhead(
    model: nn.Module, x: torch.Tensor, *, repeats: int = 3
) -> tuple[float, float]:
    """Host seconds tensor parallelism adds to a block's forward+backward (without and with
    sequence parallelism), measured on a one-rank mesh where no data moves."""
    adapter = adapter_for(model)
    names = adapter.blocks(model)
    if not names:
        return (0.0, 0.0)
    block = model.get_submodule(names[0])
    seen: list[torch.Tensor] = []
    hook = block.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(x)
    finally:
        hook.remove()
    inp = seen[0]
    plain = _time_block(copy.deepcopy(block), inp, repeats)
    out = []
    with _one_rank_mesh() as mesh:
        for sp in (False, True):
            sharded = copy.deepcopy(block)
            try:
                parallelize_module(sharded, mesh, adapter.block_plan(sharded, sequence_parallel=sp))
            except ValueError:  # no tensor plan for this model
                return (0.0, 0.0)
            out.append(max(0.0, _time_block(sharded, inp, repeats) - plain))
    return out[0], out[1]


def _time_block(block: nn.Module, x: torch.Tensor, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        inp = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        block(inp).sum().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextlib.contextmanager
def _one_rank_mesh() -> Iterator[DeviceMesh]:
    """A device mesh of this rank alone (a private group; a temporary world outside jobs)."""
    if dist.is_initialized():
        group = new_group([dist.get_rank()], use_local_synchronization=True)
        yield DeviceMesh.from_group(group, "cpu")
        dist.destroy_process_group(group)
        return
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def compute_slots(threads_per_rank: int | None = None) -> int:
    """Ranks of this job that can compute at once: per host, min(ranks, cores / threads).

    Collective over the default group (gathers host names and core counts).
    """
    threads = threads_per_rank or torch.get_num_threads()
    mine = (socket.gethostname(), usable_cpus())
    if not dist.is_initialized():
        return 1
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    hosts: dict[str, list[int]] = {}
    for host, n in every:
        hosts.setdefault(host, []).append(n)
    if torch.cuda.is_available():
        return len(every)
    return sum(min(len(c), max(1, c[0] // threads)) for c in hosts.values())


def auto_plan(
    model: nn.Module,
    *,
    sample: tuple[torch.Tensor, torch.Tensor],
    global_batch: int | None = None,
    memory_bytes: int | None = None,
    loss_fn: LossFn = cross_entropy,
    network: CollectiveCosts | AlphaBeta | None = None,
    trials: int = 4,
    trial_steps: int = 3,
) -> Choice:
    """Choose a plan for `model` in the running job (collective: every rank calls it).

    Rank 0 measures the model on `sample` while the others wait; all ranks probe the
    network together (unless `network` is given) and price every plan. The fastest
    predicted plans of the `trials` best layouts that fit then run `trial_steps` steps
    each (after one warm-up step) and the fastest measured one is chosen, so that what
    the model cannot see (host overheads of a backend, a machine's contention) decides
    between near ties.

    Args:
        model: the model as built (before `parallelize`); trials run on copies.
        sample: one per-worker batch.
        global_batch: samples per step in all (default: per-worker batch x world).
        memory_bytes: memory per device (None: unlimited).
        trials: plans to try for real (0 or 1: the model's choice stands).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    gb = global_batch or sample[0].shape[0] * world
    profile = profile_model(model, *sample, loss_fn=loss_fn) if _rank() == 0 else None
    if world > 1:
        box = [profile]
        dist.broadcast_object_list(box, src=0)
        profile = box[0]
        if network is None:
            from plait.comm.probe import probe_collectives

            network = probe_collectives()
    assert profile is not None
    hw = Hardware(
        world=world,
        network=network or AlphaBeta(alpha=0.0, beta=0.0),
        memory_bytes=memory_bytes,
        slots=compute_slots(),
        host_offload=torch.cuda.is_available(),
    )
    dims = adapter_for(model).dims(model)
    choice = choose(dims=dims, profile=profile, hardware=hw, global_batch=gb)
    if trials > 1 and world > 1:
        shortlist = _shortlist(choice.estimates, trials)
        for plan in shortlist:
            choice.measured[plan.describe()] = _trial(
                model, plan, sample=sample, global_batch=gb, loss_fn=loss_fn, steps=trial_steps
            )
        best = min(shortlist, key=lambda p: choice.measured[p.describe()])
        choice.plan = best
    if _rank() == 0:
        print(
            f"plait: planner chose {choice.plan.describe()}\n{choice.table(limit=12)}", flush=True
        )
    return choice


def _shortlist(estimates: list[Estimate], n: int) -> list[Plan]:
    """The best predicted plan of each of the `n` best layouts (degrees, ZeRO stage, sp).

    Schedules and micro-batch counts of one layout differ by what the model prices well
    (bubbles); layouts differ by backend overheads it prices worst, so trials go there.
    """
    out: list[Plan] = []
    layouts: set[tuple[Any, ...]] = set()
    for e in estimates:
        key = (e.plan.dp, e.plan.tp, e.plan.pp, e.plan.zero, e.plan.sp)
        if e.fits and key not in layouts:
            layouts.add(key)
            out.append(e.plan)
        if len(out) == n:
            break
    return out


def _trial(
    model: nn.Module,
    plan: Plan,
    *,
    sample: tuple[torch.Tensor, torch.Tensor],
    global_batch: int,
    loss_fn: LossFn,
    steps: int,
) -> float:
    """Seconds of the fastest training step of `plan` on a copy of `model` (slowest rank).

    The fastest, not the median: on shared hosts other work only ever slows a step down,
    so the minimum is the estimate of the plan's own speed that noise disturbs least.
    """
    from plait.parallel.api import ParallelModel

    pmodel = ParallelModel.build(copy.deepcopy(model), plan, loss_fn=loss_fn)
    params = list(pmodel.parameters())
    opt = pmodel.build_optimizer(torch.optim.SGD(params, lr=0.0))
    local = global_batch // pmodel.data_parallel_size
    reps = -(-local // sample[0].shape[0])
    x, y = (torch.cat([t] * reps)[:local] for t in sample)
    times = []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        pmodel.step(x, y)
        opt.step()
        if i:  # the first step warms up
            times.append(time.perf_counter() - t0)
    t = torch.tensor([min(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    del pmodel, opt, params
    return float(t)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def plan_workload(
    workload: str,
    *,
    world: int,
    network: CollectiveCosts | AlphaBeta,
    memory_bytes: int | None = None,
    slots: int | None = None,
    real: bool = False,
    batch_size: int | None = None,
    threads: int = 1,
) -> Choice:
    """The planner's choice for a named workload, measured on this machine (one process).

    `real` plans the training model and batch; otherwise the benchmark ones (`plait bench`).
    """
    from plait.workloads import get_workload

    wl = get_workload(workload)
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    batch = batch_size or (wl.train_batch if real else wl.bench_batch)
    data = wl.real() if real else wl.bench_data(max(batch, 8))
    model = wl.model(data.info, bench=not real)
    xs, ys = zip(*[data.train[i] for i in range(batch)], strict=True)
    sample = (torch.stack(list(xs)), torch.stack(list(ys)))
    profile = profile_model(model, *sample, loss_fn=wl.loss)
    hw = Hardware(world=world, network=network, memory_bytes=memory_bytes, slots=slots)
    dims = adapter_for(model).dims(model)
    states = 2 if wl.optimizer in ("adam", "adamw") else 1
    return choose(dims=dims, profile=profile, hardware=hw, global_batch=batch * world,
                  optimizer_states=states)  # fmt: skip
