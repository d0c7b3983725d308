"""Low-rank compressors step by step: data-parallel training of W workers emulated in one
process, to see where ACP-SGD and Power-SGD part ways.

Time to a target mixes two things: how long a step takes and how many steps it needs.
This tool isolates the second. It trains a workload's model on its real data as W
data-parallel workers would (the trainer's data order, one shard per worker), but in one
process: each step computes the W workers' gradients, averages them through a method's
*real* compression math (`plait.dp.compress.acpsgd.encode/decode`,
`plait.dp.compress.powersgd.encode_p/encode_q/decode`, with a separate error-feedback
store per worker and the all-reduce replaced by a mean), and steps the optimizer. Per step
it records the training loss and the relative error of the averaged approximation
against the exact average, ``|approx - mean(G)| / |mean(G)|`` over the compressed
matrices, and every `eval_every` steps the held-out loss.

    plait bench lowrank-steps --workload gpt --workers 4 --steps 80 \\
        --methods "ssgd;powersgd:rank=16;acpsgd:rank=16;acpsgd:rank=16,start=power" \\
        --target 2.6 --out DIR

Methods: ``ssgd`` (exact), ``powersgd:rank=R[,warmup=K]`` (K dense steps first, as
PyTorch's hook's ``start_powerSGD_iter``), ``acpsgd:rank=R[,warmup=K][,start=power]``
(`plait.dp.compress.ACPSGD`'s options, the same code).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from plait.bench import suites
from plait.dp.compress import acpsgd, powersgd
from plait.dp.compress.lowrank import (
    BucketPlan,
    LowRankStore,
    Phase,
    RankPolicy,
    orthonormalize_rows_,
)
from plait.flags import option
from plait.records import provenance, pyplot, save_figure, write_report
from plait.specs import parse_spec, split_specs
from plait.workloads import get_workload

logger = logging.getLogger(__name__)


@dataclass
class StepTrace:
    """One method's run: per step loss and approximation error, held-out loss by step."""

    method: str
    train_loss: list[float] = field(default_factory=list)
    rel_error: list[float] = field(default_factory=list)
    held_out: dict[int, float] = field(default_factory=dict)
    steps_to_target: int | None = None


class _Method:
    """Averages W workers' gradients (lists of tensors per worker) into one list."""

    def __init__(self, spec: str, names: list[str], workers: int) -> None:
        name, opts = parse_spec(spec)
        self.name = name
        self.rank = int(opts.pop("rank", 4))
        self.warmup = int(opts.pop("warmup", 0))
        self.start = str(opts.pop("start", "random"))
        if opts:
            raise ValueError(f"{spec!r}: unknown options {sorted(opts)}")
        if name not in ("ssgd", "powersgd", "acpsgd"):
            raise ValueError(f"{spec!r}: method must be ssgd, powersgd or acpsgd")
        self.names = names
        policy = RankPolicy(rank=self.rank)
        self.stores = [LowRankStore(policy=policy, seed=0) for _ in range(workers)]
        self.steps = 0

    def _plans(self, grads: Sequence[list[torch.Tensor]]) -> list[BucketPlan]:
        return [
            s.plan((0,), lambda: self.names, g) for s, g in zip(self.stores, grads, strict=True)
        ]

    def average(self, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """The averaged gradient the workers apply; `grads` may be overwritten."""
        step = self.steps
        self.steps += 1
        exact = [torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)]
        if self.name == "ssgd" or step < self.warmup:
            if self.name == "acpsgd":  # ACP-SGD tracks the averaged gradient while dense
                for plan in self._plans(grads):
                    acpsgd.ACPSGD._warm_factors(plan, [e.clone() for e in exact], exact[0])
            return exact
        plans = self._plans(grads)
        if self.name == "powersgd":
            return self._power(plans, grads)
        first = step == self.warmup
        if first and self.start == "power":
            out = self._power(plans, grads)
            for plan in plans:  # the Q just averaged is the basis of the next P-step
                for group in plan.groups:
                    orthonormalize_rows_(group.q)
            return out
        phase = Phase.P if (step - self.warmup) % 2 == 0 else Phase.Q
        if self.start == "power":  # after the power step the alternation starts with P
            phase = Phase.Q if phase is Phase.P else Phase.P
        wires = [p.wire_buffer(phase.value).clone() for p in plans]
        for plan, g, w in zip(plans, grads, wires, strict=True):
            acpsgd.encode(plan, g, phase, w)
        avg = torch.stack(wires).mean(0)
        for w in wires:
            w.copy_(avg)
        sends = [p.factor_views(w, phase.value) for p, w in zip(plans, wires, strict=True)]
        for plan, g, views, w in zip(plans, grads, sends, wires, strict=True):
            acpsgd.decode(plan, g, phase, views, w)
        return grads[0]

    @staticmethod
    def _power(plans: list[BucketPlan], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        p_wires = [p.wire_buffer("p").clone() for p in plans]
        q_wires = [p.wire_buffer("q", dense=False).clone() for p in plans]
        for p, g, w in zip(plans, grads, p_wires, strict=True):
            powersgd.encode_p(p, g, w)
        avg = torch.stack(p_wires).mean(0)
        for w in p_wires:
            w.copy_(avg)
        ps = [p.factor_views(w, "p") for p, w in zip(plans, p_wires, strict=True)]
        for p, pv, w in zip(plans, ps, q_wires, strict=True):
            powersgd.encode_q(p, pv, w)
        avg = torch.stack(q_wires).mean(0)
        for w in q_wires:
            w.copy_(avg)
        qs = [p.factor_views(w, "q") for p, w in zip(plans, q_wires, strict=True)]
        for p, g, pv, qv, w in zip(plans, grads, ps, qs, p_wires, strict=True):
            powersgd.decode(p, g, pv, qv, w)
        return grads[0]


def _loaders(wl: Any, data: Any, workers: int, batch: int, seed: int) -> list[Any]:
    """Each worker's stream of batches, epoch after epoch, in `plait train`'s order."""

    def stream(rank: int) -> Any:
        sampler: DistributedSampler[Any] = DistributedSampler(
            data.train, num_replicas=workers, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            loader = DataLoader(Subset(data.train, list(sampler)), batch_size=batch, drop_last=True)
            yield from loader
            epoch += 1

    return [stream(r) for r in range(workers)]


@torch.no_grad()
def _held_out(model: torch.nn.Module, wl: Any, data: Any) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in DataLoader(data.test, batch_size=256):
        out = model(x)
        total += float(wl.loss(out, y)) * len(y)
        count += len(y)
    model.train()
    return total / count


def run(
    *,
    workload: str,
    methods: Sequence[str],
    workers: int = 4,
    steps: int = 80,
    batch: int | None = None,
    lr: float | None = None,
    optimizer: str = "adamw",
    seed: int = 0,
    eval_every: int = 10,
    target: float | None = None,
) -> list[StepTrace]:
    """Train every method from the same seed; see the module docstring."""
    from plait.train.loop import build_optimizer, seed_everything

    wl = get_workload(workload)
    traces = []
    for spec in methods:
        seed_everything(seed)
        data = wl.real()
        model = wl.model(data.info)
        params = [p for p in model.parameters() if p.requires_grad]
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        opt = build_optimizer(optimizer, params, lr=lr or wl.lr)
        method = _Method(spec, names, workers)
        streams = _loaders(wl, data, workers, batch or wl.train_batch, seed)
        trace = StepTrace(method=spec)
        trace.held_out[0] = _held_out(model, wl, data)
        for step in range(1, steps + 1):
            grads, losses = [], []
            for w in range(workers):
                x, y = next(streams[w])
                model.zero_grad(set_to_none=True)
                loss = wl.loss(model(x), y)
                loss.backward()
                losses.append(float(loss.detach()))
                grads.append([p.grad.detach().clone() for p in params])  # type: ignore[union-attr]
            exact = [torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)]
            avg = method.average(grads)
            matrices = [i for i, p in enumerate(params) if p.dim() >= 2]
            num = sum(float((avg[i] - exact[i]).pow(2).sum()) for i in matrices)
            den = sum(float(exact[i].pow(2).sum()) for i in matrices)
            trace.rel_error.append(math.sqrt(num / den) if den > 0 else 0.0)
            trace.train_loss.append(sum(losses) / workers)
            for p, g in zip(params, avg, strict=True):
                p.grad = g.clone()
            opt.step()
            if step % eval_every == 0:
                trace.held_out[step] = _held_out(model, wl, data)
                reached = target is not None and trace.held_out[step] <= target
                if reached and trace.steps_to_target is None:
                    trace.steps_to_target = step
            logger.info("%s step %d loss %.4f", spec, step, trace.train_loss[-1])
        traces.append(trace)
    return traces


def markdown(traces: Sequence[StepTrace], target: float | None) -> str:
    first = [1, 2, 3, 5, 10, 20]
    lines = [
        "| method | steps to held-out loss <= "
        f"{target if target is not None else '-'} | relative error at steps "
        f"{', '.join(map(str, first))} | mean relative error, steps 11-end | held-out loss "
        "at the last evaluation |",
        "|---|---|---|---|---|",
    ]
    for t in traces:
        early = ", ".join(f"{t.rel_error[s - 1]:.2f}" for s in first if s <= len(t.rel_error))
        late = t.rel_error[10:] or [math.nan]
        last = t.held_out[max(t.held_out)]
        reached = "not reached" if t.steps_to_target is None else str(t.steps_to_target)
        lines.append(
            f"| {t.method} | {reached} | {early} | {sum(late) / len(late):.3f} | {last:.4f} |"
        )
    return "\n".join(lines) + "\n"


def plot(traces: Sequence[StepTrace], path: Path, target: float | None) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for t in traces:
        steps = sorted(t.held_out)
        axes[0].plot(steps, [t.held_out[s] for s in steps], marker="o", ms=3, label=t.method)
        axes[1].plot(range(1, len(t.rel_error) + 1), t.rel_error, label=t.method)
    if target is not None:
        axes[0].axhline(target, color="grey", linestyle="--", linewidth=1)
    axes[0].set(xlabel="step", ylabel="held-out loss")
    axes[1].set(xlabel="step", ylabel="|approx - mean(G)| / |mean(G)|", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    legend = fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        fontsize=8,
        frameon=False,
    )
    return save_figure(fig, path, dpi=120, outside=[legend])


@dataclass(frozen=True, kw_only=True)
class LowrankStepsConfig:
    """The command line of ``plait bench lowrank-steps`` (`plait.flags`).

    Attributes:
        workload: the workload trained on its real data.
        methods: the methods compared (module docstring), separated by ``;``.
        workers: the data-parallel workers emulated.
        steps: training steps of every method.
        batch_size: samples per worker and step (default: the workload's training batch).
        lr: the learning rate (default: the workload's).
        optimizer: the optimizer stepped.
        seed: weights and data order of every method.
        eval_every: steps between held-out evaluations.
        target: the held-out loss each method's steps are counted to (default: none).
        out: the folder of ``results.json``, ``results.md`` and ``results.png``.
    """

    workload: str = option("gpt")
    methods: str = option(MISSING, "';'-separated method specs")
    workers: int = option(4)
    steps: int = option(80)
    batch_size: int | None = option(None)
    lr: float | None = option(None)
    optimizer: str = option("adamw")
    seed: int = option(0)
    eval_every: int = option(10)
    target: float | None = option(None)
    out: str = option(MISSING)


def run_parsed(cfg: LowrankStepsConfig, call: suites.Call) -> int:
    """Train every method, write the report and print its table."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    traces = run(
        workload=cfg.workload,
        methods=split_specs(cfg.methods),
        workers=cfg.workers,
        steps=cfg.steps,
        batch=cfg.batch_size,
        lr=cfg.lr,
        optimizer=cfg.optimizer,
        seed=cfg.seed,
        eval_every=cfg.eval_every,
        target=cfg.target,
    )
    meta = provenance(command=call.command)
    write_report(
        Path(cfg.out),
        {"provenance": meta, "traces": [asdict(t) for t in traces]},
        title="Low-rank compressors step by step",
        command=meta["command"],
        body=markdown(traces, cfg.target),
        plot=lambda path: plot(traces, path, cfg.target),
        indent=1,
    )
    print(markdown(traces, cfg.target), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.lowrank_steps``: the suite ``lowrank-steps``
    (`plait.bench.suites`)."""
    return suites.main("lowrank-steps", argv)


if __name__ == "__main__":
    sys.exit(main())
