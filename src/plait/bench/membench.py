"""Per-rank memory of plans, measured next to the planner's prediction.

Run on every rank (``plait run --nodes 4 -m -- plait.bench.membench --out DIR``): for
each plan it builds the workload's benchmark model under a `PeakMemory` meter, applies the
plan, trains two steps (the first allocates optimizer states) and records, per rank, the
model state at rest (local shards of parameters, gradients and optimizer states) and the
peak of the second step, next to the memory model's prediction and the single-process
(unsharded) model state. Results: ``DIR/memory.json`` and ``DIR/memory.md``
(`plait.records.write_report` with the stem ``memory``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

import torch

from plait import comm
from plait import distributed as pdist
from plait.bench import suites
from plait.bench.records import MemoryRecord
from plait.flags import option
from plait.parallel.api import ParallelModel
from plait.parallel.memory import (
    PeakMemory,
    estimate_memory,
    format_bytes,
    measure_activations,
    model_state_bytes,
)
from plait.parallel.plan import Plan
from plait.parallel.resolve import adapter_for
from plait.records import write_report

logger = logging.getLogger(__name__)


def measure_plan(workload: str, plan: Plan, *, batch: int, steps: int = 2) -> dict[str, Any]:
    """Model state and peak bytes of this rank under `plan` (collective)."""
    from plait.workloads import get_workload

    wl = get_workload(workload)
    world = pdist.world_size()
    data = wl.bench_data(batch * world)
    xs, ys = zip(*[data.train[i] for i in range(batch * world)], strict=True)
    x_all, y_all = torch.stack(list(xs)), torch.stack(list(ys))
    meter = PeakMemory()
    with meter:
        torch.manual_seed(0)
        model = ParallelModel.build(wl.model(data.info, bench=True), plan, loss_fn=wl.loss)
        opt = model.build_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        local = batch * world // model.data_parallel_size
        lo = model.data_parallel_rank * local
        for i in range(steps):
            if i == steps - 1:
                meter.reset_peak()
            opt.zero_grad(set_to_none=True)
            model.step(x_all[lo : lo + local], y_all[lo : lo + local])
            opt.step()
        state = model_state_bytes(model, opt)
        peak = meter.peak
    return {"model_state_bytes": state, "peak_bytes": peak, "resolved": model.plan.describe()}


def candidate_shapes(workload: str, world: int, *, batch: int | None = None) -> list[str]:
    """Every plan shape the planner can choose for `workload` on `world` ranks: its
    candidates (`plait.parallel.planner.enumerate.candidate_plans`), one per combination of
    axes, ZeRO stage, sequence parallelism, schedule and checkpointing (the fewest
    micro-batches: more only shrink the activations in flight)."""
    from plait.parallel.planner.enumerate import candidate_plans
    from plait.workloads import get_workload

    wl = get_workload(workload)
    b = batch or wl.bench_batch
    data = wl.bench_data(b)
    model = wl.model(data.info, bench=True)
    dims = adapter_for(model).dims(model)
    seen: dict[tuple[Any, ...], str] = {}
    for plan in candidate_plans(world, dims, global_batch=b * world):
        key = (plan.dp, plan.tp, plan.pp, plan.zero, plan.sp, plan.schedule, plan.ac)
        seen.setdefault(key, plan.describe())
    return list(seen.values())


def run(workload: str, plans: list[str], *, batch: int | None = None) -> list[MemoryRecord]:
    """Measure every plan on the current process group; every rank returns the records."""
    from plait.workloads import get_workload

    wl = get_workload(workload)
    world = pdist.world_size()
    b = batch or wl.bench_batch
    data = wl.bench_data(b)
    torch.manual_seed(0)
    model = wl.model(data.info, bench=True)
    dims = adapter_for(model).dims(model)
    xs, ys = zip(*[data.train[i] for i in range(b)], strict=True)
    acts = measure_activations(model, torch.stack(list(xs)), torch.stack(list(ys)), wl.loss)
    unsharded = dims.params * 4 * (1 + 1 + 2)  # fp32 parameters, gradients, Adam's 2 states
    records: list[MemoryRecord] = []
    for text in plans:
        plan = Plan.parse(text)
        mine = measure_plan(workload, plan, batch=b)
        every = comm.all_gather_object(mine, name="membench")
        resolved = plan.validate(world=world, dims=dims)
        est = estimate_memory(resolved, dims=dims, acts=acts, global_batch=b * world)
        state_max = max(r["model_state_bytes"] for r in every)
        records.append(
            MemoryRecord(
                workload=workload,
                plan=resolved.describe(),
                world=world,
                global_batch=b * world,
                model_state_bytes=[r["model_state_bytes"] for r in every],
                peak_bytes=[r["peak_bytes"] for r in every],
                predicted_model_state_bytes=est.model_state,
                predicted_peak_bytes=est.total,
                unsharded_model_state_bytes=unsharded,
                model_state_fraction=state_max / unsharded,
                torch=torch.__version__,
            )
        )
        if pdist.is_main():
            logger.info(
                "%s: peak %s (predicted %s), model state %.3f of unsharded",
                resolved.describe(),
                format_bytes(max(r["peak_bytes"] for r in every)),
                format_bytes(est.total),
                state_max / unsharded,
            )
    return records


def markdown(records: list[MemoryRecord]) -> str:
    """Measured peak and model state per rank (the largest rank's) next to the predicted."""
    lines = [
        "| plan | peak / rank (max) | predicted peak | model state / rank (max) | predicted "
        "| model state / unsharded | x N |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        frac = r.model_state_fraction
        lines.append(
            f"| `{r.plan}` | {format_bytes(max(r.peak_bytes))} | "
            f"{format_bytes(r.predicted_peak_bytes)} | "
            f"{format_bytes(max(r.model_state_bytes))} | "
            f"{format_bytes(r.predicted_model_state_bytes)} | {frac:.3f} | "
            f"{frac * r.world:.2f} |"
        )
    return "\n".join(lines) + "\n"


def write(records: list[MemoryRecord], out: Path, *, command: str) -> dict[str, Path]:
    """Write ``memory.json`` and ``memory.md`` into `out` (the names the scorecard and the
    docs read; not ``results.*``, so they can sit beside a ``plait bench`` job's files)."""
    return write_report(
        out,
        records,
        title="Memory per rank",
        command=command,
        body=markdown(records),
        indent=2,
        stem="memory",
    )


@dataclass(frozen=True, kw_only=True)
class MembenchConfig:
    """The command line of ``plait bench membench`` (its flags, `plait.flags`).

    Attributes:
        workload: the workload whose benchmark model is measured.
        plans: the plans measured, separated by ``;``, or ``candidates``.
        batch_size: per-worker batch (default: the workload's benchmark batch).
        out: the folder of ``memory.json`` and ``memory.md``.
    """

    workload: str = option("gpt")
    plans: str = option(
        MISSING, "plans separated by ';', or 'candidates': every shape the planner can choose"
    )
    batch_size: int | None = option(None, "per-worker batch")
    out: str = option(MISSING, "output directory")


def run_parsed(cfg: MembenchConfig, call: suites.Call) -> int:
    """Measure the plans of `cfg` on every rank; the main rank writes the report."""
    pdist.init_distributed()
    try:
        torch.set_num_threads(1)
        if cfg.plans == "candidates":
            plans = candidate_shapes(cfg.workload, pdist.world_size(), batch=cfg.batch_size)
        else:
            plans = [p.strip() for p in cfg.plans.split(";") if p.strip()]
        records = run(cfg.workload, plans, batch=cfg.batch_size)
        if pdist.is_main():
            launch = f"plait run --nodes {pdist.world_size()} -m -- {call.module}"
            write(records, Path(cfg.out), command=" ".join([launch, *call.argv]))
    finally:
        pdist.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.membench``: the suite ``membench`` (`plait.bench.suites`)."""
    return suites.main("membench", argv)


if __name__ == "__main__":
    sys.exit(main())
