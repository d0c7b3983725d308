"""`parallelize`: the one call that spreads a model and its optimizer over the world.

The policy over `plait.parallel.api`'s mechanism: the plan is the one given, its text
parsed, or chosen by the planner (``"auto"``), and then applied by `ParallelModel.build`.
Kept apart from the mechanism so that the planner, which builds `ParallelModel`s for its
trials, sits between the two instead of in a circle with them.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.parallel.api import LossFn, ParallelModel, cross_entropy
from plait.parallel.plan import Plan


def parallelize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Plan | str = "auto",
    *,
    loss_fn: LossFn = cross_entropy,
    sample: tuple[torch.Tensor, torch.Tensor] | None = None,
    memory_bytes: int | None = None,
) -> tuple[ParallelModel, torch.optim.Optimizer]:
    """Spread `model` and `optimizer` over the current process group by `plan`.

    Args:
        model: the sequential model (same initial weights on every rank).
        optimizer: a fresh optimizer over `model`'s parameters; it is rebuilt over the
            parallel parameters with the same class, groups and hyper-parameters.
        plan: a `Plan`, its text (``"dp=2,tp=2,zero=3"``) or ``"auto"`` (the planner picks
            for this model, world, memory and the measured network; needs `sample`).
        loss_fn: ``loss_fn(output, target)``, a mean over the batch.
        sample: one per-rank batch ``(x, y)`` for the automatic planner.
        memory_bytes: memory per device for the automatic planner (None: unlimited).

    Returns:
        The `ParallelModel` (train with ``model.step(x, y); optimizer.step()``) and the
        optimizer to use.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    if isinstance(plan, str):
        if plan == "auto":
            from plait.parallel.planner import auto_plan, optimizer_like

            if sample is None:
                raise ValueError('plan="auto" needs a sample batch (sample=(x, y))')
            factory, states = optimizer_like(optimizer)
            plan = auto_plan(
                model,
                sample=sample,
                memory_bytes=memory_bytes,
                loss_fn=loss_fn,
                optimizer=factory,
                optimizer_states=states,
            ).plan
        else:
            plan = Plan.parse(plan)
    pmodel = ParallelModel.build(model, plan, loss_fn=loss_fn)
    optimizer._plait_names = names  # type: ignore[attr-defined]
    return pmodel, pmodel.build_optimizer(optimizer)
