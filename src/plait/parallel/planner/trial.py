"""Trial runs: shortlisted plans train for real, metered; the fastest that fits wins.

The price model cannot see everything (host overheads of a backend, contention on a
machine); between near ties a short measurement decides. Nor is its memory exact: it
errs on both sides (0.86-1.11 of the meter on the bundled and Hugging Face workloads), so
a plan predicted just under the budget can run over it (a 79.2 MiB prediction metered
83.0 MiB against an 80 MiB budget). Each trial therefore meters the plan's peak as well as its
time, and a plan over the budget is replaced by the next layout, never chosen.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait import comm
from plait.parallel.api import LossFn, OptimizerFactory
from plait.parallel.memory import PeakMemory, format_bytes
from plait.parallel.plan import Plan
from plait.parallel.planner.price import Estimate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trial:
    """One plan's trial: its fastest step (slowest rank) and metered peak (largest rank)."""

    step_s: float
    peak_bytes: int


def layouts(estimates: list[Estimate]) -> Iterator[Plan]:
    """The best predicted fitting plan of each layout (degrees, ZeRO stage, sp), in order.

    Schedules and micro-batch counts of one layout differ by what the model prices well
    (bubbles); layouts differ by backend overheads it prices worst, so trials go there.
    """
    seen: set[tuple[Any, ...]] = set()
    for e in estimates:
        key = (e.plan.dp, e.plan.tp, e.plan.pp, e.plan.zero, e.plan.sp)
        if e.fits and key not in seen:
            seen.add(key)
            yield e.plan


def shortlist(estimates: list[Estimate], n: int) -> list[Plan]:
    """The first `n` of `layouts` (the plans the trials start with)."""
    out: list[Plan] = []
    for plan in layouts(estimates):
        if len(out) == n:
            break
        out.append(plan)
    return out


def select(
    candidates: Iterable[Plan],
    run: Callable[[Plan], Trial],
    *,
    trials: int,
    memory_bytes: int | None,
) -> tuple[Plan | None, dict[str, Trial]]:
    """Run candidates in order until `trials` of them fit; return the fastest that fits.

    A candidate whose metered peak exceeds `memory_bytes` does not count towards
    `trials`: the next one is tried in its place, so a budget the model misjudged costs
    trial time, not a plan that runs out of memory. Returns (None, ...) when no
    candidate fits; every trial run is in the returned mapping (plan text -> `Trial`).
    """
    ran: dict[str, Trial] = {}
    fitting: list[tuple[float, Plan]] = []
    for plan in candidates:
        if len(fitting) == trials:
            break
        trial = run(plan)
        ran[plan.describe()] = trial
        if memory_bytes is not None and trial.peak_bytes > memory_bytes:
            logger.info(
                "planner: %s metered %s per rank, over the %s budget; trying the next layout",
                plan.describe(),
                format_bytes(trial.peak_bytes),
                format_bytes(memory_bytes),
            )
            continue
        fitting.append((trial.step_s, plan))
    if not fitting:
        return None, ran
    return min(fitting, key=lambda tp: tp[0])[1], ran


#: State tensors per parameter of the optimizers `plait train` names (the memory model's
#: `optimizer_states`): Adam's two moments, SGD's momentum, Muon's momentum (the AdamW
#: it runs for vectors keeps two, but on few and small tensors), SOAP's two moments (its
#: Kronecker factors are per layer, not per element).
OPTIMIZER_STATES = {
    "sgd": 1,
    "sgd-plain": 0,
    "adam": 2,
    "adamw": 2,
    "muon": 1,
    "muon-fp32": 1,
    "heavyball-soap": 2,
}


def optimizer_states_of(name: str) -> int:
    """`OPTIMIZER_STATES` of an optimizer name; 2 (the most) for one it does not know."""
    return OPTIMIZER_STATES.get(name, 2)


def optimizer_like(template: torch.optim.Optimizer) -> tuple[OptimizerFactory, int]:
    """A factory of `template`'s class and defaults, and its states per parameter (SGD:
    1 with momentum, else 0; the Adam family and any other class: 2, the most)."""
    cls, defaults = type(template), dict(template.defaults)
    if isinstance(template, torch.optim.SGD):
        states = 1 if defaults.get("momentum", 0) else 0
    else:
        states = 2
    return (lambda params: cls(params, **defaults)), states


def stand_in_optimizer(states: int) -> OptimizerFactory:
    """An optimizer with `states` tensors per parameter (AdamW 2, SGD with momentum 1,
    plain SGD 0), at learning rate 0, for trials whose caller did not say which."""
    if states >= 2:
        return lambda params: torch.optim.AdamW(params, lr=0.0)
    if states == 1:
        return lambda params: torch.optim.SGD(params, lr=0.0, momentum=0.9)
    return lambda params: torch.optim.SGD(params, lr=0.0)


def run_trial(
    model: nn.Module,
    plan: Plan,
    *,
    sample: tuple[torch.Tensor, torch.Tensor],
    global_batch: int,
    loss_fn: LossFn,
    steps: int,
    optimizer: OptimizerFactory,
) -> Trial:
    """Train `plan` on a copy of `model`: meter its peak, then time `steps` steps.

    The copy is built and its first two steps run under a `PeakMemory` meter: the first
    allocates the optimizer's states, the second's peak is the plan's (as `plait.bench.
    membench` measures it). The timed steps follow outside the meter, whose bookkeeping
    after every operator would slow them. The fastest timed step is kept, not the median:
    on shared hosts other work only ever slows a step down, so the minimum is the estimate
    of the plan's own speed that noise disturbs least. Collective: every rank calls it.
    """
    from plait.parallel.api import ParallelModel

    local_model = copy.deepcopy(model)
    meter = PeakMemory()
    meter.track([*local_model.parameters(), *local_model.buffers()])
    with meter:
        pmodel = ParallelModel.build(local_model, plan, loss_fn=loss_fn)
        del local_model
        opt = pmodel.build_optimizer(optimizer(list(pmodel.parameters())))
        local = global_batch // pmodel.data_parallel_size
        reps = -(-local // sample[0].shape[0])
        x, y = (torch.cat([t] * reps)[:local] for t in sample)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            pmodel.step(x, y)
            opt.step()

        step()
        meter.reset_peak()
        step()
    times = []
    for _ in range(steps):
        comm.barrier(name="trial step")
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    step_s, peak = comm.reduce_floats([min(times), float(meter.peak)], op="max", name="trial")
    return Trial(step_s=step_s, peak_bytes=int(peak))
