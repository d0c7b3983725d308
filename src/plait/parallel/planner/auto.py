"""The planner's entry points: a plan for a model in a running job, or for a workload.

`auto_plan` runs inside the job (every rank calls it): it profiles the model, probes the
network, prices every candidate and lets trial runs decide between the best layouts.
`plan_workload` plans a registered or user workload from one process, for `plait plan`.
Both return a `Choice` (the plan, every estimate and `Choice.reason`); neither prints:
the decision goes to the ``plait`` logger and renderers show the table.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.comm import AlphaBeta, CollectiveCosts
from plait.parallel.api import LossFn, OptimizerFactory, cross_entropy
from plait.parallel.memory import format_bytes
from plait.parallel.planner.price import Choice, Hardware, choose
from plait.parallel.planner.profile import compute_slots, profile_model
from plait.parallel.planner.trial import (
    Trial,
    layouts,
    optimizer_states_of,
    run_trial,
    select,
    stand_in_optimizer,
)
from plait.parallel.resolve import adapter_for

logger = logging.getLogger(__name__)


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
    optimizer: OptimizerFactory | None = None,
    optimizer_states: int = 2,
) -> Choice:
    """Choose a plan for `model` in the running job (collective: every rank calls it).

    Rank 0 measures the model on `sample` while the others wait; all ranks probe the
    network together (unless `network` is given) and price every plan. The fastest
    predicted plans of the `trials` best layouts that fit then train for real on copies
    of the model (`trial.run_trial`): each one's peak memory is metered and `trial_steps`
    steps timed. A plan metered over `memory_bytes` is replaced by the next layout; of
    those that fit, the fastest measured is chosen, so that what the model cannot see
    (host overheads of a backend, a machine's contention, its own memory error) decides.

    Args:
        model: the model as built (before `parallelize`); trials run on copies.
        sample: one per-worker batch.
        global_batch: samples per step in all (default: per-worker batch x world).
        memory_bytes: memory per device (None: unlimited).
        trials: plans to try for real (0 or 1: the model's choice stands).
        optimizer: builds the optimizer the job will train with, over given parameters
            (trials step with it, so its states are metered); None: a stand-in with
            `optimizer_states` states per parameter at learning rate 0.
        optimizer_states: state tensors per parameter of the job's optimizer (AdamW 2,
            SGD with momentum 1), for the memory model.

    Raises:
        ValueError: no plan fits `memory_bytes`, by the model or by the trials' meter.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    gb = global_batch or sample[0].shape[0] * world
    profile = profile_model(model, *sample, loss_fn=loss_fn) if _rank() == 0 else None
    if world > 1:
        profile = comm.broadcast_object(profile, src=0, name="planner profile")
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
    choice = choose(
        dims=dims,
        profile=profile,
        hardware=hw,
        global_batch=gb,
        optimizer_states=optimizer_states,
    )
    choice.model_notes += model_notes(model)
    if trials > 1 and world > 1:
        factory = optimizer or stand_in_optimizer(optimizer_states)
        best, ran = select(
            layouts(choice.estimates),
            lambda plan: run_trial(
                model,
                plan,
                sample=sample,
                global_batch=gb,
                loss_fn=loss_fn,
                steps=trial_steps,
                optimizer=factory,
            ),
            trials=trials,
            memory_bytes=memory_bytes,
        )
        choice.measured = {plan: t.step_s for plan, t in ran.items()}
        choice.metered = {plan: t.peak_bytes for plan, t in ran.items()}
        if best is None:
            raise ValueError(
                f"no plan fits in {format_bytes(memory_bytes or 0)} per device: the memory "
                f"model's {len(ran)} best layouts all metered over it in trial runs "
                f"({_metered(ran)})"
            )
        choice.plan = best
    if _rank() == 0:
        logger.info("planner: %s", choice.reason)
        logger.debug("planner estimates:\n%s", choice.table(limit=12))
    return choice


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
    choice = choose(
        dims=dims,
        profile=profile,
        hardware=hw,
        global_batch=batch * world,
        optimizer_states=optimizer_states_of(wl.optimizer),
    )
    choice.model_notes += model_notes(model)
    return choice


def model_notes(model: nn.Module) -> list[str]:
    """What the planner knows of the model's splits, in words (for `Choice.reason`)."""
    adapter = adapter_for(model)
    blocks = adapter.blocks(model)
    if not blocks:
        return [f"{type(model).__name__} has no block stack: data parallelism and ZeRO only"]
    source = getattr(adapter, "plan_source", None)
    where = f" from {source()}" if callable(source) else ""
    return [
        f"{len(blocks)} blocks of {type(model).__name__} ({blocks[0]}, ...); tensor plan{where}"
    ]


def _metered(ran: dict[str, Trial]) -> str:
    return ", ".join(f"{plan} {format_bytes(t.peak_bytes)}" for plan, t in ran.items())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
