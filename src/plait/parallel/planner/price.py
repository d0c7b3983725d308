"""Pricing: a plan's predicted step time and memory, and the choice among plans.

Each candidate is priced with

- the memory model of `plait.parallel.memory` (activations measured on the model), which
  rejects plans that do not fit the memory per device; and
- a time model: the model's forward+backward time measured on this device, split over
  the ranks that compute it (with the pipeline bubble of the schedule, the recomputation
  of checkpointing, the work tensor parallelism replicates, and the CPU cores ranks share
  when several run on one host), plus every collective of the plan priced by the
  alpha-beta model of `plait.comm` fitted to the *measured* network.

`choose` picks the fastest plan that fits; its `Choice` explains the decision in words
(`Choice.reason`) and as a table (`Choice.table`). Nothing here measures or prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plait.comm import AlphaBeta, Collective, CollectiveCosts
from plait.parallel.adapters import ModelDims
from plait.parallel.memory import ActivationProfile, MemoryEstimate, estimate_memory, format_bytes
from plait.parallel.plan import Plan, Schedule, ZeroStage
from plait.parallel.planner.enumerate import candidate_plans, excluded_degrees

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


#: The memory model's largest under-estimate of a metered peak on the bundled and Hugging
#: Face workloads (predicted / metered 0.859, the GPT's `dp=1,tp=2,pp=2,sp=true,ac=true`;
#: benchmarks/parallel/memory-candidates): a plan predicted above this share of the budget
#: may run over it. Trial runs in a job meter the plans
#: they try (`trial`); a plan priced without them says so in `Choice.reason`.
MEMORY_MODEL_LOW = 0.859


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
    metered: dict[str, int] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)
    model_notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Estimate:
        return next(e for e in self.estimates if e.plan == self.plan)

    @property
    def reason(self) -> str:
        """Why this plan, in one paragraph: its price, the runner-up, what was ruled out.

        A user who did not write the model can check the decision against what they know
        (a slow network favours fewer collectives, a small memory forces sharding) without
        reading the table.
        """
        best = self.best
        comm = sum(best.comm_s.values())
        parts = [
            f"chose {self.plan.describe()}: predicted {best.time_s:.3f} s/step "
            f"({best.compute_s:.3f} s compute, {comm:.3f} s communication), "
            f"{format_bytes(best.memory.total)} per rank"
        ]
        others = [e for e in self.estimates if e.fits and e.plan != self.plan]
        if others:
            nxt = min(others, key=lambda e: e.time_s)
            parts.append(
                f"the next fitting plan {nxt.plan.describe()} is predicted "
                f"{nxt.time_s / max(best.time_s, 1e-12):.2f}x its time"
            )
        oom = sum(1 for e in self.estimates if not e.fits)
        if oom:
            parts.append(
                f"{oom} of {len(self.estimates)} plans do not fit in "
                f"{format_bytes(self.hardware.memory_bytes or 0)} per device"
            )
        budget = self.hardware.memory_bytes
        if (
            budget is not None
            and not self.metered
            and best.memory.total > MEMORY_MODEL_LOW * budget
        ):
            parts.append(
                f"its predicted memory is within {1 - MEMORY_MODEL_LOW:.0%} of the budget, "
                f"where the model has erred low (down to {MEMORY_MODEL_LOW} of the meter): "
                "trial runs in a job (plan:auto) meter it before training"
            )
        if self.measured:
            key = self.plan.describe()
            parts.append(
                f"trial runs of {len(self.measured)} layouts decided"
                + (f" ({self.measured[key]:.3f} s/step measured)" if key in self.measured else "")
            )
        over = [p for p, b in self.metered.items() if budget is not None and b > budget]
        if over:
            parts.append(
                f"{len(over)} metered over the budget in trials and were passed over "
                f"({', '.join(over)})"
            )
        parts += self.excluded + self.model_notes
        return "; ".join(parts)

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
            key = e.plan.describe()
            if key in self.measured:
                verdict += f"; trial {self.measured[key]:.3f} s"
            if key in self.metered:
                peak = self.metered[key]
                over = hw.memory_bytes is not None and peak > hw.memory_bytes
                verdict += f", metered {format_bytes(peak)}" + (" (over)" if over else "")
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
            "metered": self.metered,
            "global_batch": self.global_batch,
            "sample_s": self.profile.sample_s,
            "reason": self.reason,
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
        plan,
        dims=dims,
        acts=profile.acts,
        global_batch=global_batch,
        optimizer_states=optimizer_states,
        bytes_per_param=bytes_per_param,
        offload_counts=not hardware.host_offload,
        foreach=hardware.host_offload,  # a GPU, where torch's optimizers default to foreach
    )
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
    return Choice(
        plan=estimates[0].plan,
        estimates=estimates,
        hardware=hardware,
        dims=dims,
        global_batch=global_batch,
        profile=profile,
        excluded=excluded_degrees(hardware.world, dims),
    )
