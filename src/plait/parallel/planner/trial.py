"""Trial runs: a few shortlisted plans train for real and the fastest measured one wins.

The price model cannot see everything (host overheads of a backend, contention on a
machine); between near ties a short measurement decides.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.parallel.api import LossFn
from plait.parallel.plan import Plan
from plait.parallel.planner.price import Estimate


def shortlist(estimates: list[Estimate], n: int) -> list[Plan]:
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


def trial_step_time(
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
