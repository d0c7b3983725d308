"""Which floating-point choices of a host change a training run, and whether pinning holds.

Two hosts of the same kind gave one race different trajectories. A CPU run's arithmetic
depends on the kernels its libraries dispatch to: ATen's vectorised kernels (by the CPU
capability it detects: AVX-512, AVX2 or none), MKL's BLAS (by the instruction set MKL
picks for the CPU), oneDNN's convolutions (likewise), and the number of threads that
split each reduction. Kernels of different width or split sum in different orders, and
rounding then differs in the last bits; training amplifies those bits step by step.

This study trains one model from one seed in a fresh process per setting, each setting
forcing one of those choices the way another host would make it, and compares the runs
with the host's own default: the first step whose loss differs, the largest parameter
difference at the end, and when each run first meets the race's held-out targets (an
accuracy decided on a small split, and a loss). The pinned setting (`plait.cpu.AVX2_PINS`,
what `plait race` gives its workers) is run twice, to show that a pinned run repeats
bit for bit.

    plait bench dispatch --out benchmarks/race/float-dispatch
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from plait.bench import suites
from plait.cpu import AVX2_PINS
from plait.flags import option

#: Each setting as another host would make its choice (environment, threads).
SETTINGS: dict[str, tuple[dict[str, str], int]] = {
    "host default": ({}, 1),
    "ATen without vector kernels": ({"ATEN_CPU_CAPABILITY": "default"}, 1),
    "oneDNN at SSE4.1": ({"ONEDNN_MAX_CPU_ISA": "SSE41"}, 1),
    "MKL compatible path": ({"MKL_CBWR": "COMPATIBLE"}, 1),
    "two threads": ({}, 2),
    "pinned (AVX2)": (dict(AVX2_PINS), 1),
    "pinned (AVX2), again": (dict(AVX2_PINS), 1),
}


@dataclass
class Run:
    """One setting's training run."""

    setting: str
    env: dict[str, str]
    threads: int
    losses: list[float]
    evals: dict[int, dict[str, float]]
    params_sha: str
    params: list[float]


def _child(config: Mapping[str, Any]) -> dict[str, Any]:
    """Train in this process (the environment was set before torch was imported)."""
    import torch
    from torch.utils.data import DataLoader

    from plait.train.loop import build_optimizer, seed_everything
    from plait.workloads import get_workload

    torch.set_num_threads(int(config["threads"]))
    wl = get_workload(config["workload"])
    seed_everything(int(config["seed"]))
    data = wl.real()
    model = wl.model(data.info)
    opt = build_optimizer(config["optimizer"], model.parameters(), lr=float(config["lr"]))
    gen = torch.Generator().manual_seed(int(config["seed"]))
    losses: list[float] = []
    evals: dict[int, dict[str, float]] = {}
    step = 0
    while step < int(config["steps"]):
        loader = DataLoader(
            data.train, batch_size=int(config["batch"]), shuffle=True, generator=gen, drop_last=True
        )
        for x, y in loader:
            model.train()
            opt.zero_grad()
            loss = wl.loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            step += 1
            if step % int(config["eval_every"]) == 0:
                evals[step] = _evaluate(model, wl, data)
            if step >= int(config["steps"]):
                break
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "losses": losses,
        "evals": evals,
        "params_sha": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "params": flat.tolist(),
    }


def _evaluate(model: Any, wl: Any, data: Any) -> dict[str, float]:
    import torch
    from torch.utils.data import DataLoader

    model.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in DataLoader(data.test, batch_size=512):
            out = model(x)
            loss += float(wl.loss(out, y)) * len(y)
            right, n = wl.correct(out, y)
            correct, count = correct + right, count + n
    return {"test_loss": loss / count, "test_accuracy": correct / count}


def run_setting(name: str, config: Mapping[str, Any], *, timeout_s: float = 1800.0) -> Run:
    """Train under setting `name` in a fresh interpreter."""
    env_extra, threads = SETTINGS[name]
    env = {k: v for k, v in os.environ.items() if k not in AVX2_PINS}
    env.update(env_extra)
    env["OMP_NUM_THREADS"] = str(threads)
    payload = json.dumps({**config, "threads": threads})
    proc = subprocess.run(
        [sys.executable, "-m", "plait.bench.dispatch", "--child", payload],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"setting {name!r} failed:\n{proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    evals = {int(k): v for k, v in out["evals"].items()}
    return Run(name, env_extra, threads, out["losses"], evals, out["params_sha"], out["params"])


def first_hit(run: Run, key: str, target: float, higher: bool) -> int | None:
    """The first evaluation step whose `key` meets `target`."""
    for step in sorted(run.evals):
        value = run.evals[step][key]
        if (value >= target) if higher else (value <= target):
            return step
    return None


def compare(runs: list[Run], *, accuracy: float, loss: float) -> list[dict[str, Any]]:
    """Each run against the first (the host default)."""
    base = runs[0]
    rows = []
    for r in runs:
        differ = next(
            (i + 1 for i, (a, b) in enumerate(zip(r.losses, base.losses, strict=True)) if a != b),
            None,
        )
        diff = max(abs(a - b) for a, b in zip(r.params, base.params, strict=True))
        rows.append(
            {
                "setting": r.setting,
                "env": r.env,
                "threads": r.threads,
                "first_different_step": differ,
                "max_param_diff": diff,
                "identical": r.params_sha == base.params_sha,
                "steps_to_accuracy": first_hit(r, "test_accuracy", accuracy, True),
                "steps_to_loss": first_hit(r, "test_loss", loss, False),
                "final_accuracy": r.evals[max(r.evals)]["test_accuracy"],
                "final_loss": r.evals[max(r.evals)]["test_loss"],
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], *, accuracy: float, loss: float) -> str:
    lines = [
        f"| setting | environment | first step whose loss differs | largest parameter "
        f"difference at the end | steps to accuracy {accuracy:g} | steps to loss {loss:g} "
        "| final accuracy | final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        env = ", ".join(f"{k}={v}" for k, v in r["env"].items()) or "-"
        if r["threads"] != 1:
            env += f" (threads {r['threads']})"
        differ = "none (bit for bit)" if r["identical"] else str(r["first_different_step"])
        lines.append(
            f"| {r['setting']} | {env} | {differ} | {r['max_param_diff']:.2e} "
            f"| {r['steps_to_accuracy']} | {r['steps_to_loss']} | {r['final_accuracy']:.4f} "
            f"| {r['final_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """The command line of ``plait bench dispatch`` (its flags, `plait.flags`).

    Attributes:
        child: a setting's training config as JSON: the process `run_setting` starts
            trains it and prints its run (hidden from ``--help``).
        workload: the workload trained.
        optimizer: its optimizer.
        lr: its learning rate.
        batch: samples per step.
        steps: training steps of every setting.
        eval_every: steps between evaluations on the held-out split.
        seed: weights and data order of every setting.
        accuracy: the held-out accuracy target each run is timed to.
        loss: the held-out loss target each run is timed to.
        out: folder for ``results.json`` and ``results.md`` (default: print the table only).
    """

    child: str | None = option(None, hidden=True)
    workload: str = option("digits-cnn")
    optimizer: str = option("adamw")
    lr: float = option(0.01)
    batch: int = option(128, "4 workers x 32, as the race")
    steps: int = option(150)
    eval_every: int = option(5)
    seed: int = option(0)
    accuracy: float = option(0.97)
    loss: float = option(0.1)
    out: str | None = option(None)


def run_parsed(cfg: DispatchConfig, call: suites.Call) -> int:
    """Train every setting in a fresh process, print the comparison and, with ``--out``,
    write the report (or, given ``--child``, train one setting here and print its run)."""
    if cfg.child is not None:
        print(json.dumps(_child(json.loads(cfg.child))))
        return 0
    config = {
        k: getattr(cfg, k)
        for k in ("workload", "optimizer", "lr", "batch", "steps", "eval_every", "seed")
    }
    runs = [run_setting(name, config) for name in SETTINGS]
    rows = compare(runs, accuracy=cfg.accuracy, loss=cfg.loss)
    text = markdown(rows, accuracy=cfg.accuracy, loss=cfg.loss)
    print(text, end="")
    if cfg.out:
        from plait.records import provenance, write_report

        meta = provenance(command=call.command)
        write_report(
            Path(cfg.out),
            {
                "provenance": meta,
                "config": config,
                "rows": rows,
                "runs": [{**asdict(r), "params": []} for r in runs],
            },
            title="Floating-point dispatch",
            command=meta["command"],
            body=text,
            indent=1,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.dispatch``: the suite ``dispatch`` (`plait.bench.suites`)."""
    return suites.main("dispatch", argv)


if __name__ == "__main__":
    sys.exit(main())
