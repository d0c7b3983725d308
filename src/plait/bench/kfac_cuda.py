"""K-FAC on one CUDA device: what a step costs with factors expanded and reduced.

On the CPU hosts of the other benchmarks the factor products of a convolution's expanded
patches cost more than the convolution itself, and K-FAC-reduce (one factor row per
sample) cut a digits CNN's factor update from 5.5 to 3.5 ms. This measures the same choice
where K-FAC is usually run, a GPU: side by side in one process, with the same model,
weights and batch, a step of

- SGD alone (forward, backward, update), and the first-order steps users pick instead of
  K-FAC: AdamW and Muon (`torch.optim.Muon` for the matrices, AdamW for the rest);
- K-FAC with factors and inverses every step (``factor_interval=1, inv_interval=1``),
  `expand` and `reduce`;
- K-FAC with factors every step and inverses every 100 (the factor update and the
  preconditioning without decompositions), `expand` and `reduce`,

each timed from before the forward to after ``torch.cuda.synchronize()`` behind the
update, median of `steps` after `warmup`, the entries taking turns step by step so that
clocks and other load affect them alike.

    plait bench kfac-cuda [--workload resnet18] [--batch 128] [--device cuda] [--out DIR]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.bench import suites
from plait.flags import option
from plait.kfac import KFAC, KFACConfig
from plait.records import provenance, write_report
from plait.train.loop import build_optimizer
from plait.workloads import get_workload

#: (label, K-FAC settings or None for the optimizer alone, optimizer); K-FAC runs over SGD.
ENTRIES: tuple[tuple[str, dict[str, Any] | None, str], ...] = (
    ("sgd", None, "sgd"),
    ("adamw", None, "adamw"),
    ("muon", None, "muon"),
    ("kfac expand, inv 1", {"approximation": "expand", "inv_interval": 1}, "sgd"),
    ("kfac reduce, inv 1", {"approximation": "reduce", "inv_interval": 1}, "sgd"),
    ("kfac expand, inv 100", {"approximation": "expand", "inv_interval": 100}, "sgd"),
    ("kfac reduce, inv 100", {"approximation": "reduce", "inv_interval": 100}, "sgd"),
)


@dataclass
class _Run:
    label: str
    model: nn.Module
    opt: torch.optim.Optimizer
    kfac: KFAC | None
    times: list[float] = field(default_factory=list)


def _batch(workload: str, batch: int, device: torch.device) -> tuple[nn.Module, Any, Any]:
    wl = get_workload(workload)
    data = wl.bench_data(batch)
    torch.manual_seed(0)
    model = wl.model(data.info, bench=True).to(device)
    x = torch.stack([data.train[i][0] for i in range(batch)]).to(device)
    y = torch.as_tensor([int(data.train[i][1]) for i in range(batch)]).to(device)
    return model, x, y


def measure(
    *,
    workload: str = "resnet18",
    batch: int = 128,
    steps: int = 30,
    warmup: int = 5,
    device: str = "cuda",
) -> list[dict[str, Any]]:
    """Median step seconds of every entry of `ENTRIES` on `device`, taking turns.

    Raises:
        ValueError: `device` is CUDA and there is none.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("kfac_cuda needs a CUDA device (torch.cuda.is_available() is false)")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    wl = get_workload(workload)
    base, x, y = _batch(workload, batch, dev)
    runs = []
    for label, options, optimizer in ENTRIES:
        model = copy.deepcopy(base)
        opt = build_optimizer(optimizer, model.parameters(), lr=0.01, momentum=0.9)
        kfac = None
        if options is not None:
            cfg = KFACConfig(damping=0.01, factor_interval=1, lr=0.01, probe=False, **options)
            kfac = KFAC(model, cfg, optimizer=opt)
        runs.append(_Run(label, model, opt, kfac))
    for step in range(warmup + steps):
        for run in runs:
            sync()
            t0 = time.perf_counter()
            run.opt.zero_grad(set_to_none=True)
            wl.loss(run.model(x), y).backward()
            if run.kfac is not None:
                run.kfac.step()
            run.opt.step()
            sync()
            if step >= warmup:
                run.times.append(time.perf_counter() - t0)
    sgd = statistics.median(runs[0].times)
    out = []
    for run in runs:
        med = statistics.median(run.times)
        out.append({
            "label": run.label, "median_s": med, "min_s": min(run.times),
            "max_s": max(run.times), "vs_sgd": med / sgd,
        })  # fmt: skip
        if run.kfac is not None:
            run.kfac.remove()
    return out


def title(meta: dict[str, Any]) -> str:
    """The report's title: the workload and the batch."""
    return f"K-FAC on one CUDA device: {meta['workload']}, batch {meta['batch']}"


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The device and the protocol, then every entry's step time."""
    lines = [
        f"{meta['device_name']}, torch {meta['torch']}; median of {meta['steps']} steps "
        f"after {meta['warmup']}, entries taking turns step by step.",
        "",
        "| entry | step (ms) | min-max (ms) | vs SGD |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {1e3 * r['median_s']:.2f} | "
            f"{1e3 * r['min_s']:.2f}-{1e3 * r['max_s']:.2f} | {r['vs_sgd']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The title and the table, as printed."""
    return f"# {title(meta)}\n\n{table(rows, meta)}"


@dataclass(frozen=True, kw_only=True)
class KfacCudaConfig:
    """The command line of ``plait bench kfac-cuda`` (its flags, `plait.flags`).

    Attributes:
        workload: the workload whose model is timed.
        batch: samples per step.
        steps: timed steps of every entry (the median is reported).
        warmup: untimed steps of every entry before them.
        device: ``cuda``, or ``cpu`` to rehearse the entries.
        out: folder for ``results.json`` and ``results.md`` (default: print the table only).
    """

    workload: str = option("resnet18")
    batch: int = option(128)
    steps: int = option(30)
    warmup: int = option(5)
    device: str = option("cuda", "cuda (default) or cpu")
    out: Path | None = option(None)


def run_parsed(cfg: KfacCudaConfig, call: suites.Call) -> int:
    """Time every entry, print the table and, with ``--out``, write the report.

    Without a CUDA device (``--device cuda``) it says so and exits with status 2.
    """
    try:
        rows = measure(
            workload=cfg.workload, batch=cfg.batch, steps=cfg.steps, warmup=cfg.warmup,
            device=cfg.device,
        )  # fmt: skip
    except ValueError as e:
        print(f"kfac_cuda: {e}", file=sys.stderr)
        return 2
    meta = {
        "workload": cfg.workload, "batch": cfg.batch, "steps": cfg.steps,
        "warmup": cfg.warmup,
        "device_name": torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu",
        "torch": torch.__version__, **provenance(command=call.command),
    }  # fmt: skip
    sys.stdout.write(markdown(rows, meta))
    if cfg.out is not None:
        write_report(
            cfg.out,
            {"meta": meta, "rows": rows},
            title=title(meta),
            command=call.command,
            body=table(rows, meta),
            indent=1,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.kfac_cuda``: the suite ``kfac-cuda`` (`plait.bench.suites`)."""
    return suites.main("kfac-cuda", argv)


if __name__ == "__main__":
    raise SystemExit(main())
