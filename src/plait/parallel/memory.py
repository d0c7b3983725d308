"""Memory: the planner's model of a plan's footprint per rank, and a meter for the real one.

The model (`estimate_memory`) counts, per rank, the model state (parameters, gradients and
optimizer states, each divided by the axes that shard it), the buffers the engines add
(FSDP's unsharded blocks and their gradients), the activations kept for backward (per
block and micro-batch, times the micro-batches a schedule keeps in flight; one block input
per block under activation checkpointing) and the transients of single tensors (a fresh
gradient before it joins its bucket, the optimizer's temporaries). The peak is the largest
of three moments: the activations' peak, with the gradients only where they already exist
then (DDP's buckets, a 1F1B pipeline); the end of backward, with every gradient; and the
optimizer's update. Activation sizes are measured on the model itself
(`measure_activations`, whose count of saved tensors already runs a few percent above the
meter, so no headroom is added), not assumed, and so is the share of them tensor
parallelism splits (read from the block's own tensor plan); a pipeline's stages are
counted one by one (the first keeps the embeddings', the last the head's and every
micro-batch's output); the model is checked against the meter on
every plan shape the planner can choose, on the bundled and Hugging Face workloads
(benchmarks/parallel/memory-candidates).

`PeakMemory` measures what a step really holds: a dispatch mode that sees every tensor
storage an operator creates (unwrapping DTensors to their local shards) and follows its
size (FSDP resizes storages in place) until it is freed. It works on any device, CPU
included, where allocator statistics do not exist.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator, Mapping
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
#: Share of a block's saved activations that tensor parallelism splits, where a profile
#: has none measured (built by hand; a model without a tensor plan cannot be split
#: anyway). Measured shares (`measure_activations`) are 0.75 on the bundled GPT, 0.83 on
#: the Hugging Face GPT-2, 0.80 on BERT and 0.65 on Llama.
TP_SPLIT_SHARE = 0.9


@dataclass(frozen=True, kw_only=True)
class ActivationProfile:
    """Bytes saved for backward per sample: in one block, and outside the blocks.

    Attributes:
        block: saved by one block per sample.
        other: saved outside the blocks per sample (embeddings, head, loss).
        block_input: one block's input per sample (what checkpointing keeps).
        largest: the largest tensor a block saves, per sample. A block's backward holds
            gradients of its activations a few at a time, about two of the largest (the
            GPT's MLP hidden), not a whole block's worth: counting a block over-estimated
            the tiny Hugging Face GPT-2's peak by 30%.
        head: the part of `other` saved after the last block (final norm, head, loss), per
            sample; the rest is saved before the first (embeddings). A pipeline's first
            and last stages hold one each.
        head_largest: the largest tensor saved outside the blocks, per sample (the
            logits' log-softmax of a language model). The loss's backward holds two of
            its size at the start of backward (the tiny Llama's peak on the meter).
        output: the model's output per sample (the logits). A pipeline's last stage
            keeps every micro-batch's output until the step ends (the schedule returns
            them): under the tiny Llama's `tp=2,pp=2` two micro-batches' logits were a
            fifth of the last stage's peak.
        tp_split: share of `block` that tensor parallelism splits over its ranks (without
            sequence parallelism): what is computed from a column-parallel layer's output
            up to a row-parallel layer's input. Measured on the block's own tensor plan
            (`_SplitTracer`): it differs by model (`TP_SPLIT_SHARE`); Llama's RMSNorms
            save whole-width tensors that no tensor-parallel rank splits.
    """

    block: float
    other: float
    block_input: float
    largest: float = 0.0
    head: float = 0.0
    head_largest: float = 0.0
    output: float = 0.0
    tp_split: float = TP_SPLIT_SHARE


def measure_activations(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any
) -> ActivationProfile:
    """Run one forward of `model` on `(x, y)` and count what autograd saves, per sample."""
    from plait.parallel.resolve import adapter_for

    adapter = adapter_for(model)
    blocks = [model.get_submodule(b) for b in adapter.blocks(model)]
    current: list[int] = [-1]
    per_block: dict[int, int] = {}
    seen: set[int] = set()
    inputs: list[int] = []
    tracer = _SplitTracer()

    largest = {True: 0, False: 0}  # in a block, outside
    after_blocks = [False]
    head = [0]
    split_bytes = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in seen and not isinstance(t, nn.Parameter):
            seen.add(key)
            size = t.untyped_storage().nbytes()
            per_block[current[0]] = per_block.get(current[0], 0) + size
            head[0] += size if after_blocks[0] and current[0] < 0 else 0
            inside = current[0] >= 0
            largest[inside] = max(largest[inside], size)
            if inside:
                split_bytes[0] += size if tracer.is_split(t) else 0
        return t

    handles = []
    for i, block in enumerate(blocks):

        def pre(_: nn.Module, args: Any, i: int = i) -> None:
            current[0] = i
            if i == 0 and args:
                inputs.append(args[0].numel() * args[0].element_size())

        def post(*_: Any, last: bool = i == len(blocks) - 1) -> None:
            current[0] = -1
            after_blocks[0] = last

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
        handles += tracer.watch(block, _tensor_plan(adapter, block))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen |= params
    try:
        with tracer, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
            output = sum(
                t.untyped_storage().nbytes()
                for t in tree_leaves(dict(out) if isinstance(out, Mapping) else out)
                if isinstance(t, torch.Tensor)
            )
            loss = loss_fn(out, y)
        del loss, out
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
        largest=largest[True] / n,
        head_largest=largest[False] / n,
        head=head[0] / n,
        output=output / n,
        tp_split=split_bytes[0] / block_total if tracer.watched and block_total else TP_SPLIT_SHARE,
    )


def _tensor_plan(adapter: Any, block: nn.Module) -> dict[str, Any]:
    """The block's tensor-parallel styles, or none for a model without a tensor plan."""
    try:
        return dict(adapter.block_plan(block, sequence_parallel=False))
    except ValueError:
        return {}


def _follow(live: dict[int, Any], storage: Any) -> None:
    """Keep `storage` in `live` (by its address) until it is freed: an address freed and
    reused by another storage is never taken for the first."""
    key = storage._cdata
    if key not in live:
        live[key] = weakref.ref(storage)
        weakref.finalize(storage, live.pop, key, None)


class _SplitTracer(TorchDispatchMode):
    """Which tensors of a forward tensor parallelism would split over its ranks.

    A column-parallel layer's output is split (its output features are); so is whatever
    an operator computes from a split tensor; a row-parallel layer's output is whole again
    (its all-reduce). Norms, residuals and a column-parallel layer's input stay whole.
    Storages are followed while alive (an address freed and reused is not confused).
    """

    def __init__(self) -> None:
        super().__init__()
        self._split: dict[int, Any] = {}
        self.watched = False

    def watch(self, block: nn.Module, styles: dict[str, Any]) -> list[Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from plait.parallel.derive import FusedColwiseParallel

        handles = []
        for name, style in styles.items():
            try:
                module = block.get_submodule(name)
            except AttributeError:
                continue
            if isinstance(style, (ColwiseParallel, FusedColwiseParallel)):
                handles.append(module.register_forward_hook(lambda _m, _a, out: self._mark(out)))
                self.watched = True
            elif isinstance(style, RowwiseParallel):
                handles.append(module.register_forward_hook(lambda _m, _a, out: self._unmark(out)))
        return handles

    def is_split(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self._split

    def _mark(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                _follow(self._split, t.untyped_storage())

    def _unmark(self, out: Any) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._split.pop(t.untyped_storage()._cdata, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(isinstance(a, torch.Tensor) and self.is_split(a) for a in tree_leaves(args)):
            self._mark(out)
        return out


# ------------------------------------------------------------------------- model
@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes per rank (the most loaded rank) under a plan.

    Attributes:
        params, grads, optimizer: the model state (this rank's shards).
        buffers: what the engines hold through forward and backward (FSDP's unsharded
            parameters, and the unsharded gradients of the block being reduced).
        activations: saved for backward at their peak, with a block's backward temporaries.
        grad_transient: a fresh gradient before it is copied into its bucket or added to
            the one already accumulated (DDP, pipelines), beside the activations.
        after_backward: what the step holds beside the gradients once the activations are
            gone (gradient averaging's fused bucket).
        step_transient: the optimizer's temporaries while it updates (Adam's denominator).
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
    grad_transient: float = 0.0
    after_backward: float = 0.0
    step_transient: float = 0.0
    grads_with_activations: bool = True

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The peak: the model state, and the largest of three moments beside it: the
        activations' peak (with the engines' buffers), the end of backward and the
        optimizer's update."""
        during = (
            self.buffers
            + self.activations
            + self.grad_transient
            + (self.grads if self.grads_with_activations else 0.0)
        )
        after = self.grads + self.after_backward
        update = self.grads + self.step_transient
        return self.params + self.optimizer + max(during, after, update)


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


def _stage_activations(
    plan: Plan, rank: int, kept: float, acts: ActivationProfile, mb: float
) -> float:
    """What pipeline rank `rank` (one stage) keeps saved at once under GPipe or 1F1B.

    GPipe holds every micro-batch on every stage; 1F1B holds ``pp - rank`` on rank
    `rank` (the first stage warms up the most). The first stage also keeps the
    embeddings' activations, the last the head's: counting the head on the first stage's
    in-flight micro-batches over-estimated the tiny Llama's 1F1B peak by 25%.
    """
    m = plan.n_microbatches()
    n = m if plan.schedule is Schedule.GPIPE else min(m, plan.pp - rank)
    last = rank == plan.pp - 1
    ends = (acts.other - acts.head) * (rank == 0) + acts.head * last
    return n * (kept + ends * mb) + m * acts.output * mb * last


def backward_beside_forward(plan: Plan) -> bool:
    """Whether a pipeline's first backward runs while later micro-batches' activations are
    held, so its gradients exist beside them: 1F1B and interleaved with more micro-batches
    than stages. With as many as stages, the first rank runs every forward before its
    first backward, as GPipe does (the GPT's dp=2,pp=2 with 2 micro-batches: 105.3 MiB
    under 1F1B, 105.7 under GPipe)."""
    return (
        plan.pp > 1
        and plan.schedule in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED)
        and plan.n_microbatches() > plan.pp
    )


def grads_with_activations(plan: Plan) -> bool:
    """Whether a rank's gradients all exist while its activations peak (`MemoryEstimate`)."""
    if plan.zero >= ZeroStage.GRADIENTS:
        # FSDP's shards appear block by block (`fsdp_backward_held`); under a pipeline
        # they appear after the last micro-batch, the whole gradients before (buffers)
        return False
    if plan.pp > 1:
        return backward_beside_forward(plan)
    # DDP (data parallel alone, ZeRO 0-1) keeps its gradients as its buckets
    return (plan.dp or 1) > 1 and plan.tp == 1


def _rank_blocks(plan: Plan, dims: ModelDims) -> list[int]:
    """Parameters of each block the most loaded pipeline rank holds, in forward order
    (blocks may differ in size); [] for a model without blocks."""
    per_stage = dims.stage_blocks(plan.n_stages())
    ranks = [
        [b for j in stage_indices(plan.schedule, plan.pp, r) for b in per_stage[j]]
        for r in range(plan.pp)
    ]
    return max(ranks, key=sum)


def fsdp_backward_held(
    zero: ZeroStage,
    blocks: list[float],
    root: float,
    dp: int,
    block_acts: float = 0.0,
    *,
    own_acts: float | None = None,
) -> float:
    """Bytes FSDP2 holds beside its parameter shards and the activations at the peak of
    one backward.

    Backward runs the blocks in reverse; while block i's gradients are reduce-scattered
    its whole gradients and the reduce-scatter's padded copy of them coexist (2 x block
    i, less block i's own activations, freed by then), beside the gradient shards of the
    blocks after it and the unsharded parameters still held: under ZeRO-2 (no resharding
    after forward) every block up to i and the root's own (`root`: parameters outside
    the blocks); under ZeRO-3 block i's alone. The later blocks' activations
    (`block_acts` each) are freed by then, and are subtracted, as are block i's own
    (`own_acts`, the recomputed ones under checkpointing; default `block_acts`).
    A model without blocks is one unit, its root, whose whole parameters and gradients peak
    together with the activations of the layers not yet differentiated (ResNet-18 and VGG
    under dp=4,zero=2: within 1% of the meter). On the MLP's blocks of 8, 16, 8 and 0.04
    MiB this puts the peak at the 16 MiB block within 3% of the meter (ZeRO-3 as measured
    shows no prefetched block beside it: counting one overshot by 16%).
    """
    held = 2 * root + sum(blocks) / dp - len(blocks) * block_acts
    for i, b in enumerate(blocks):
        params = sum(blocks[: i + 1]) if zero is ZeroStage.GRADIENTS else b
        later = blocks[i + 1 :]
        # the copy is made once block i's own activations are freed
        grads = 2 * b - min(b, block_acts if own_acts is None else own_acts)
        held = max(held, params + root + grads + (sum(later) / dp - len(later) * block_acts))
    return held


def estimate_memory(
    plan: Plan,
    *,
    dims: ModelDims,
    acts: ActivationProfile,
    global_batch: int,
    optimizer_states: int = 2,
    bytes_per_param: int = 4,
    offload_counts: bool = True,
    foreach: bool = False,
) -> MemoryEstimate:
    """Per-rank bytes of `plan` (resolved); see the module docstring.

    Args:
        optimizer_states: tensors the optimizer keeps per parameter (Adam 2, SGD+momentum 1).
        offload_counts: count offloaded state (it lives in host memory: on a CPU "device"
            it still counts).
        foreach: the optimizer updates every tensor at once (torch's default on CUDA) and
            holds one temporary per parameter; otherwise (CPU's default) it updates one
            tensor at a time, with `optimizer_states` temporaries of that tensor at most.
    """
    dp, tp, pp = plan.dp or 1, plan.tp, plan.pp
    s = bytes_per_param
    stages = plan.n_stages()
    other_bytes = dims.other_params * s  # embeddings/head: replicated over tp; one stage each
    block_bytes = [b * s / tp for b in _rank_blocks(plan, dims)]  # the most loaded rank's
    local = sum(block_bytes) + other_bytes
    shard = local / dp
    zero = plan.zero
    fsdp = zero >= ZeroStage.GRADIENTS  # FSDP2 shards parameters, gradients and states
    largest = min(dims.largest_param * s, local) if dims.largest_param else 0.0
    # what this rank's optimizer updates: ZeroRedundancyOptimizer gives each rank whole
    # tensors, so one rank updates the largest
    if zero is ZeroStage.NONE:
        updated = local
    elif zero is ZeroStage.OPTIMIZER:
        updated = max(shard, largest)
    else:
        updated = shard
    offloaded = plan.offload and not offload_counts
    params = (0.0 if offloaded else shard) if fsdp else local
    grads = (0.0 if offloaded else shard) if fsdp else local
    opt = 0.0 if offloaded else optimizer_states * updated
    # the update: Adam's denominator (sqrt of the second moment, then scaled) of every
    # tensor at once, or of one tensor at a time, two temporaries of it (the MLP's 16 MiB
    # layer under dp=4 peaks 32 MiB above its model state in the update, on the meter)
    step_transient = updated if foreach else optimizer_states * (largest / dp if fsdp else largest)
    buffers = 0.0
    after = 0.0
    if fsdp and pp > 1:
        # a pipeline unshards a stage once for all its micro-batches and reduce-scatters
        # after the last: its parameters are whole from the first forward on, its gradients
        # add up whole from the first backward (beside later micro-batches' activations
        # under 1F1B) to the end, where both are held with the last fresh gradient (the
        # MLP's dp=2,pp=2: the same peak at zero=2 and zero=3)
        buffers = local * (2 if backward_beside_forward(plan) else 1)
        after = 2 * local + largest - shard  # the gradient shards come later, in their place
    # DDP's gradients are views of its buckets (plait.data_parallel's default): no second
    # copy. plait's gradient averaging (tensor/pipeline parallel) fuses after backward,
    # when the activations are gone: its bucket never coexists with them.
    synced = dp > 1 and zero <= ZeroStage.OPTIMIZER and (tp > 1 or pp > 1)
    if synced:
        after = min(local, 25 * 2**20)
    # a fresh gradient is a tensor of its own until it is copied into DDP's bucket or added
    # to the micro-batches' sum; alone, a plain backward's gradient is the tensor it keeps
    ddp = dp > 1 and not fsdp and tp == 1 and pp == 1
    grad_transient = largest if ddp or pp > 1 else 0.0
    # activations
    local_samples = global_batch / dp
    mb = local_samples / plan.n_microbatches()
    split = 1 / tp if plan.sp else (acts.tp_split / tp + 1 - acts.tp_split)
    per_block = acts.block * split * mb
    stage_blocks = math.ceil(dims.layers / stages)
    # a block's backward temporaries (`ActivationProfile.largest`) ride on everything
    # saved; checkpointing keeps each micro-batch's block inputs, and while a block is
    # recomputed and differentiated, its activations beside them
    temporaries = 2 * acts.largest * split * mb
    kept = stage_blocks * (acts.block_input * mb if plan.ac else per_block)
    # a first stage keeps the embeddings' activations of every micro-batch in flight
    other = acts.other * mb
    recomputed = per_block if plan.ac else 0.0
    if plan.ac and pp == 1:
        # without a pipeline the head's activations (the logits and their log-softmax)
        # are freed by its backward before the first block is recomputed: the two peak
        # apart (Hugging Face Llama under dp=4,ac=true: counting both over-estimated the
        # meter by 17%). What is subtracted is the head's and the embeddings' (`other`),
        # where a pipeline's last stage subtracts the head's alone: the embeddings' output
        # is also block 0's checkpointed input, counted in `kept`. Subtracting the head's
        # alone here moves 33 committed plans up (the HF BERT's to 1.06-1.13 of the meter,
        # GPT-2's closer to 1.0); every one of the 231 stays within 15% either way.
        recomputed = max(per_block - other, 0.0)
    loss_grads = 2 * acts.head_largest * mb
    if pp > 1 and plan.schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        # on the last stage the micro-batch being differentiated has freed its head's
        # activations before its blocks are recomputed, as without a pipeline
        last_recomputed = max(per_block - acts.head * mb, 0.0) if plan.ac else 0.0
        activations = max(
            _stage_activations(plan, r, kept, acts, mb)
            + (
                max(last_recomputed + temporaries, loss_grads)
                if r == pp - 1
                else recomputed + temporaries
            )
            for r in range(pp)
        )
    else:
        # backward starts in the loss: two gradients of the logits' size beside all that
        # is saved (the two moments peak apart)
        held = in_flight(plan) * (kept + other)
        activations = held + max(recomputed + temporaries, loss_grads)
    if fsdp and pp == 1:
        saved = kept / len(block_bytes) if block_bytes else 0.0
        buffers = fsdp_backward_held(
            plan.zero, block_bytes, other_bytes, dp, saved, own_acts=per_block
        )
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=opt,
        buffers=buffers,
        activations=activations,
        grad_transient=grad_transient,
        after_backward=after,
        step_transient=step_transient,
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

    A storage's size is read again after every operator, not only at its creation: FSDP2
    frees and re-allocates its unsharded parameters by resizing their storages in place
    (``untyped_storage().resize_``), which no dispatch mode sees. Counting them at their
    first size kept every unsharded parameter alive for the whole step (on the MLP under
    ``dp=4,zero=3``, 32 MiB of a 103 MiB peak).
    """

    current: int = 0
    peak: int = 0
    _live: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            for local in _local_tensors(t):
                self._add(local)
        self._refresh()

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        _follow(self._live, storage)

    def _refresh(self) -> None:
        total = 0
        for ref in list(self._live.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        self.current = total
        self.peak = max(self.peak, total)

    def reset_peak(self) -> None:
        self._refresh()
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for local in _local_tensors(leaf):
                    self._add(local)
        self._refresh()
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
