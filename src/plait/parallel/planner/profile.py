"""Profiling: the model measured on this device, as the pricing needs it.

`profile_model` times forward+backward per sample, the blocks' share of it and the
activations autograd keeps; `tensor_parallel_overhead` times the host work DTensor adds to
one block on a one-rank mesh (no data moves); `compute_slots` counts the ranks that can
compute at once on the hosts of the job.
"""

from __future__ import annotations

import contextlib
import copy
import socket
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from plait import comm
from plait._proc import usable_cpus
from plait.distributed import new_group
from plait.parallel.api import LossFn, cross_entropy
from plait.parallel.memory import measure_activations
from plait.parallel.planner.price import ComputeProfile
from plait.parallel.resolve import adapter_for
from plait.workloads import logits_of


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
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def grab(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # blocks of models nobody here wrote take more than the hidden states (position
        # embeddings, masks, hidden states by keyword): replay the call as the model made it
        if not seen:
            seen.append((args, dict(kwargs)))

    hook = block.register_forward_pre_hook(grab, with_kwargs=True)
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


def _time_block(
    block: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]], repeats: int
) -> float:
    args, kwargs = call
    times = []
    for i in range(repeats + 1):
        if args:
            a, kw = (args[0].detach().clone().requires_grad_(True), *args[1:]), kwargs
        else:
            h = kwargs["hidden_states"].detach().clone().requires_grad_(True)
            a, kw = args, {**kwargs, "hidden_states": h}
        t0 = time.perf_counter()
        out = block(*a, **kw)
        logits_of(out).sum().backward()
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
    every = comm.all_gather_object(mine, name="compute slots")
    hosts: dict[str, list[int]] = {}
    for host, n in every:
        hosts.setdefault(host, []).append(n)
    if torch.cuda.is_available():
        return len(every)
    return sum(min(len(c), max(1, c[0] // threads)) for c in hosts.values())
