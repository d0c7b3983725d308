"""Memory: the planner's model of a plan's footprint per rank, and a meter for the real one.

The model (`estimate_memory`) counts, per rank, the model state (parameters, gradients and
optimizer states, each divided by the axes that shard it), the buffers the engines add
(FSDP's unsharded blocks) and the activations kept for backward (per block and
micro-batch, times the micro-batches a schedule keeps in flight; one block input per
block under activation checkpointing). The peak is the larger of two moments: the
activations' peak, with the gradients only where they already exist then (DDP's buckets,
a 1F1B pipeline), and the end of backward, with every gradient. Activation sizes are
measured on the model itself (`measure_activations`), not assumed; the model is checked
against the meter below on every plan shape (benchmarks/parallel/memory.md).

`PeakMemory` measures what a step really holds: a dispatch mode that sees every tensor
storage an operator creates (unwrapping DTensors to their local shards) and follows it
until it is freed. It works on any device, CPU included, where allocator statistics do not
exist.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from plait.parallel.pipeline import stage_indices
from plait.parallel.plan import Plan, Schedule, ZeroStage
from plait.units import parse_size

if TYPE_CHECKING:
    from plait.parallel.adapters import ModelDims


def parse_bytes(text: str | int) -> int:
    """``"2GiB"`` (2 * 2**30), ``"512MB"`` (512 * 10**6), ``"1e9"`` or an int, in bytes.

    The same parser as every other size in plait (`plait.units.parse_size`), so binary and
    decimal units mean what they say and a bare ``G`` is refused as ambiguous.

    Raises:
        ValueError: not a size.
    """
    return parse_size(text, what="memory size")


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


# ------------------------------------------------------------------ measurements
@dataclass(frozen=True, kw_only=True)
class ActivationProfile:
    """Bytes saved for backward per sample: in one block, and outside the blocks.

    Attributes:
        block: saved by one block per sample.
        other: saved outside the blocks per sample (embeddings, head, loss).
        block_input: one block's input per sample (what checkpointing keeps).
    """

    block: float
    other: float
    block_input: float


def measure_activations(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any
) -> ActivationProfile:
    """Run one forward of `model` on `(x, y)` and count what autograd saves, per sample."""
    from plait.parallel.adapters import adapter_for

    adapter = adapter_for(model)
    blocks = [model.get_submodule(b) for b in adapter.blocks(model)]
    current: list[int] = [-1]
    per_block: dict[int, int] = {}
    seen: set[int] = set()
    inputs: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in seen and not isinstance(t, nn.Parameter):
            seen.add(key)
            per_block[current[0]] = per_block.get(current[0], 0) + t.untyped_storage().nbytes()
        return t

    handles = []
    for i, block in enumerate(blocks):

        def pre(_: nn.Module, args: Any, i: int = i) -> None:
            current[0] = i
            if i == 0 and args:
                inputs.append(args[0].numel() * args[0].element_size())

        def post(*_: Any) -> None:
            current[0] = -1

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen |= params
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(x), y)
        del loss
    finally:
        for h in handles:
            h.remove()
    n = x.shape[0]
    n_blocks = max(1, len(blocks))
    block_total = sum(v for k, v in per_block.items() if k >= 0)
    return ActivationProfile(
        block=block_total / n_blocks / n,
        other=per_block.get(-1, 0) / n,
        block_input=(inputs[0] if inputs else 0) / n,
    )


# ------------------------------------------------------------------------- model
@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes per rank (the most loaded rank) under a plan.

    Attributes:
        params, grads, optimizer: the model state (this rank's shards).
        buffers: what the engines hold through the step (FSDP's unsharded parameters).
        activations: saved for backward at their peak, with a block's backward temporaries.
        after_backward: what the step holds beside the gradients once the activations are
            gone (gradient averaging's fused bucket).
        grads_with_activations: whether every gradient exists while the activations peak
            (DDP's gradients are its buckets, allocated once; a 1F1B pipeline's first
            backward creates its stage's gradients while later micro-batches' activations
            are still held) or only appear as they are freed (the gradients of one plain
            backward, GPipe's and zero-bubble's weight gradients).
    """

    params: float
    grads: float
    optimizer: float
    buffers: float
    activations: float
    after_backward: float = 0.0
    grads_with_activations: bool = True

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The peak: the model state and buffers, and the larger of the activations'
        peak and the end of backward."""
        during = self.activations + (self.grads if self.grads_with_activations else 0.0)
        after = self.grads + self.after_backward
        return self.params + self.optimizer + self.buffers + max(during, after)


#: Share of a block's saved activations that tensor parallelism splits (projections, MLP
#: hidden, attention) when norms and residuals stay replicated (no sequence parallelism).
#: Measured on the GPT (benchmarks/parallel/memory.md): `dp=2,tp=2` peaks with 0.55 of a
#: block's activations per rank at this share, within 2% of the meter.
TP_SPLIT_SHARE = 0.9


#: Headroom on activations for what the count of saved tensors misses (allocator
#: rounding, the loss's temporaries): the planner must not under-estimate. A plain
#: backward of the GPT (benchmarks/parallel/memory.md, `dp=1`) peaks 3% above the saved
#: tensors plus one block's backward temporaries; 10% covers it with room.
ACTIVATION_MARGIN = 0.1


def in_flight(plan: Plan) -> int:
    """(Micro-batch, stage) pairs whose activations a rank holds at once, at most."""
    m = plan.n_microbatches()
    if plan.pp == 1:
        return 1
    if plan.schedule is Schedule.GPIPE:
        return m
    if plan.schedule is Schedule.ONE_F_ONE_B:
        return min(m, plan.pp)
    # two stages per rank: warm-up fills both; in the V of zero-bubble a micro-batch's
    # last stage runs its backward straight after its forward, one pair fewer
    pairs = min(2 * m, 3 * plan.pp)
    return pairs - 1 if plan.schedule is Schedule.ZERO_BUBBLE else pairs


def grads_with_activations(plan: Plan) -> bool:
    """Whether a rank's gradients all exist while its activations peak (`MemoryEstimate`)."""
    if plan.pp > 1:  # 1F1B's first backward runs while later micro-batches are held
        return plan.schedule in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED)
    if plan.zero >= ZeroStage.GRADIENTS:
        # FSDP's gradient shards appear as backward reduce-scatters its first blocks,
        # while the others' activations are held: counted, at 1/dp of the gradients
        return True
    # DDP (data parallel alone, ZeRO 0-1) keeps its gradients as its buckets
    return (plan.dp or 1) > 1 and plan.tp == 1


def estimate_memory(
    plan: Plan,
    *,
    dims: ModelDims,
    acts: ActivationProfile,
    global_batch: int,
    optimizer_states: int = 2,
    bytes_per_param: int = 4,
    offload_counts: bool = True,
) -> MemoryEstimate:
    """Per-rank bytes of `plan` (resolved); see the module docstring.

    Args:
        optimizer_states: tensors the optimizer keeps per parameter (Adam 2, SGD+momentum 1).
        offload_counts: count offloaded state (it lives in host memory: on a CPU "device"
            it still counts).
    """
    dp, tp, pp = plan.dp or 1, plan.tp, plan.pp
    s = bytes_per_param
    stages = plan.n_stages()
    block_bytes = dims.block_params * s / tp
    other_bytes = dims.other_params * s  # embeddings/head: replicated over tp; one stage each
    if dims.layers:
        # the most loaded rank's stages, block by block (blocks may differ in size)
        per_stage = dims.stage_params(stages)
        held = max(
            sum(per_stage[j] for j in stage_indices(plan.schedule, pp, r)) for r in range(pp)
        )
        local = held * s / tp + other_bytes
    else:
        local = other_bytes
    shard = local / dp
    zero = plan.zero
    offloaded = plan.offload and not offload_counts
    params = (
        (0.0 if offloaded else shard)
        if zero is ZeroStage.PARAMETERS or zero is ZeroStage.GRADIENTS
        else local
    )
    grads = (0.0 if offloaded else shard) if zero >= ZeroStage.GRADIENTS else local
    opt = optimizer_states * (shard if zero >= ZeroStage.OPTIMIZER else local)
    if offloaded:
        opt = 0.0
    buffers = 0.0
    if zero is ZeroStage.GRADIENTS:
        buffers += local  # unsharded parameters live from forward to the end of backward
        if pp > 1 and grads_with_activations(plan):
            # a pipeline reduce-scatters once, after its last micro-batch: the gradients
            # accumulate unsharded from the first backward on, beside later activations
            buffers += local
    elif zero is ZeroStage.PARAMETERS:
        # current and prefetched block (all-gather input and output), the root's own
        # parameters, and the unsharded gradients of the block being reduced
        buffers += 4 * block_bytes + other_bytes + 2 * block_bytes
    # DDP's gradients are views of its buckets (plait.data_parallel's default): no second
    # copy. plait's gradient averaging (tensor/pipeline parallel) fuses after backward,
    # when the activations are gone: its bucket never coexists with them.
    synced = dp > 1 and zero <= ZeroStage.OPTIMIZER and (tp > 1 or pp > 1)
    after = min(local, 25 * 2**20) if synced else 0.0
    # activations
    local_samples = global_batch / dp
    mb = local_samples / plan.n_microbatches()
    split = 1 / tp if plan.sp else (TP_SPLIT_SHARE / tp + 1 - TP_SPLIT_SHARE)
    per_block = acts.block * split * mb
    stage_blocks = math.ceil(dims.layers / stages)
    # checkpointing keeps each micro-batch's block inputs, and while a block is recomputed
    # and differentiated its activations and temporaries: three blocks' worth on the GPT
    # (`dp=4,zero=3,ac=true` measured 61.8 MiB above its model state, 2 blocks would say
    # 49.5); without it, a block's backward temporaries ride on everything saved
    kept = stage_blocks * (acts.block_input * mb if plan.ac else per_block)
    # a first stage keeps the embeddings' activations of every micro-batch in flight
    activations = in_flight(plan) * (kept + acts.other * mb) + (3 if plan.ac else 1) * per_block
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=opt,
        buffers=buffers,
        activations=activations * (1 + ACTIVATION_MARGIN),
        after_backward=after,
        grads_with_activations=grads_with_activations(plan),
    )


# ------------------------------------------------------------------------ meter
def _local_tensors(t: Any) -> Iterator[torch.Tensor]:
    """The plain tensors holding `t`'s data (a DTensor's local shard)."""
    if not isinstance(t, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for a in attrs:
            yield from _local_tensors(getattr(t, a))
    else:
        yield t


@dataclass
class PeakMemory(TorchDispatchMode):
    """Live and peak bytes of tensor storages created while the mode is active.

    Use around model construction and training; `reset_peak()` starts a new peak from the
    current live bytes (e.g. after set-up, to measure steady steps). `track` adds storages
    created before the mode (or outside the dispatcher).
    """

    current: int = 0
    peak: int = 0
    _live: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            for local in _local_tensors(t):
                self._add(local)

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        if key in self._live:
            return
        n = storage.nbytes()
        self._live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for local in _local_tensors(leaf):
                    self._add(local)
        return out


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's parameters, gradients and optimizer states (local shards)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None:
            return
        for local in _local_tensors(t):
            st = local.untyped_storage()
            if st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard
    if inner is not None:
        for state in inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    add(v)
    return total
