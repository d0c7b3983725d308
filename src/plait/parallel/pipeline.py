"""Pipeline parallelism: cut the model into stages and drive a pipelining schedule.

The model's adapter lists it as a chain of units (embedding, blocks, head). Blocks are
spread evenly over the stages; units before the first block join the first stage, the
others the stage of the block before them. A stage is a `StageModule` that registers its
units under their original qualified names, so a stage's ``state_dict`` keys are the full
model's keys: distributed checkpoints move between pipeline layouts and plans unchanged.

Stages run under the schedules of `torch.distributed.pipelining` (GPipe, 1F1B, looped
interleaved 1F1B, zero-bubble ZB-V). Rank r of the pipeline axis holds stage r, or stages
r and r + pp (interleaved), or r and 2 pp - 1 - r (the V of zero-bubble).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from plait.parallel.adapters import BoundUnit, Unit
from plait.parallel.plan import Schedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class StageModule(nn.Module):
    """Consecutive units of a model, run in order, keeping their original state keys."""

    def __init__(self, units: Sequence[Unit]) -> None:
        super().__init__()
        chain: list[nn.Module] = []
        for name, module in units:
            if isinstance(module, BoundUnit):
                for target_name, target in module.targets.items():
                    _register_at(self, target_name, target)
            elif name:
                _register_at(self, name, module)
            else:  # a wrapper whose attributes carry top-level names
                for child_name, child in module.named_children():
                    _register_at(self, child_name, child)
            chain.append(module)
        self._chain = tuple(chain)  # not registered: the modules are registered above
        self.units: tuple[Unit, ...] = tuple(units)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self._chain:
            x = module(x)
        return x


def _register_at(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, module)


def stage_indices(schedule: Schedule, pp: int, pp_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds."""
    if pp == 1:
        return [0]
    if schedule is Schedule.INTERLEAVED:
        return [pp_rank, pp_rank + pp]
    if schedule is Schedule.ZERO_BUBBLE:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank]


def split_units(units: Sequence[Unit], blocks: Sequence[str], n_stages: int) -> list[list[Unit]]:
    """Units per stage: blocks evenly, other units with their neighbouring block.

    Raises:
        ValueError: fewer blocks than stages.
    """
    block_set = set(blocks)
    n_blocks = sum(1 for name, _ in units if name in block_set)
    if n_blocks < n_stages:
        raise ValueError(
            f"{n_stages} pipeline stages need at least {n_stages} blocks, got {n_blocks}"
        )
    out: list[list[Unit]] = [[] for _ in range(n_stages)]
    seen = 0
    stage = 0
    for unit in units:
        if unit[0] in block_set:
            stage = seen * n_stages // n_blocks
            seen += 1
        out[stage].append(unit)
    return out


def check_untied(stages: Sequence[Sequence[Unit]]) -> None:
    """Raise ValueError when one parameter sits in two stages (tied weights).

    Tied input and output embeddings (GPT-2's ``wte`` and ``lm_head``) would train as two
    copies on the first and last stage and drift apart.
    """
    owner: dict[int, tuple[int, str]] = {}
    for s, units in enumerate(stages):
        for unit_name, module in units:
            mods = (
                module.targets.items() if isinstance(module, BoundUnit) else [(unit_name, module)]
            )
            for prefix, m in mods:
                for pname, p in m.named_parameters():
                    where = owner.setdefault(id(p), (s, f"{prefix}.{pname}".strip(".")))
                    if where[0] != s:
                        raise ValueError(
                            f"pipeline: parameter {where[1]} (stage {where[0]}) is tied to "
                            f"{prefix}.{pname} (stage {s}); untie it (for transformers "
                            "models: tie_word_embeddings=False) or use pp=1"
                        )


def build_schedule(
    schedule: Schedule,
    stages: list[_PipelineStageBase],
    *,
    n_microbatches: int,
    loss_fn: LossFn,
) -> Any:
    """The `torch.distributed.pipelining` schedule object for `schedule`.

    Gradients are scaled by the number of micro-batches (`scale_grads`), so a mean loss per
    micro-batch gives the gradient of the mean loss over the whole batch.
    """
    if schedule is Schedule.GPIPE:
        return ScheduleGPipe(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=True)
    if schedule is Schedule.ONE_F_ONE_B:
        return Schedule1F1B(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=True)
    if schedule is Schedule.INTERLEAVED:
        return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return ScheduleZBVZeroBubble(stages, n_microbatches, loss_fn=loss_fn, scale_grads=True)
