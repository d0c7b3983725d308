"""Sweep reports: results.json (every trial with its curve), results.md, curves.png.

Reports are shared and committed; the storage URL and the command line are recorded with
any password masked (`plait.fused.sweep.storage.mask_url`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

import optuna

from plait.fused.sweep.runner import SweepConfig, SweepResult
from plait.fused.sweep.storage import mask_secrets, mask_url
from plait.records import command_line, git_commit, machine, pyplot, save_figure


def _plain(value: Any) -> Any:
    """A config value for JSON: numbers as they are, enums by value, objects by class."""
    if isinstance(value, int | float | bool | None | str):
        return value if not isinstance(value, StrEnum) else value.value
    if isinstance(value, optuna.pruners.BasePruner | optuna.samplers.BaseSampler):
        return type(value).__name__
    return str(value)


def to_json(result: SweepResult, cfg: SweepConfig, task: str) -> dict[str, Any]:
    config = {f.name: _plain(getattr(cfg, f.name)) for f in fields(cfg)}
    if cfg.storage is not None:
        config["storage"] = mask_url(cfg.storage)
    return {
        "task": task,
        "study": result.study,
        "storage": mask_url(result.storage),
        "config": config,
        "capacities": result.capacities,
        "elapsed_s": result.elapsed_s,
        "trials": [asdict(r) for r in result.records],
        "command": mask_secrets(command_line(), cfg.storage),
        "commit": git_commit(),
        "machine": machine(),
    }


def markdown(data: dict[str, Any]) -> str:
    trials = sorted(data["trials"], key=lambda r: -(r["value"] if r["value"] is not None else -1))
    keys = sorted({k for r in trials for k in r["params"]})
    head = "| trial | " + " | ".join(keys) + " | state | epochs | val. accuracy | array (size) |\n"
    head += "|---" * (len(keys) + 5) + "|\n"
    rows = []
    for r in trials:
        vals = [
            f"{r['params'][k]:.3g}"
            if isinstance(r["params"].get(k), float)
            else str(r["params"].get(k, ""))
            for k in keys
        ]
        value = f"{r['value']:.4f}" if r["value"] is not None else f"({r['curve'][-1]:.4f})"
        where = f"{r['array']} ({r['array_size']})"
        tail = f" | {r['state'].lower()} | {len(r['curve'])} | {value} | {where} |"
        rows.append(f"| #{r['number']} | " + " | ".join(vals) + tail)
    states = [r["state"] for r in trials]
    summary = (
        f"# Sweep `{data['study']}` ({data['task']})\n\n"
        f"Command: `{mask_secrets(data['command'])}`\n\n"
        f"{len(trials)} trials: {states.count('COMPLETE')} complete, "
        f"{states.count('PRUNED')} pruned, {states.count('FAIL')} failed; "
        f"{data['elapsed_s']:.0f} s; largest arrays that fit: {data['capacities']}.\n\n"
        f"commit {data['commit']}, torch {data['machine']['torch']}, "
        f"{data['machine']['cpus']} CPUs\n\n"
    )
    return summary + head + "\n".join(rows) + "\n"


def plot(data: dict[str, Any], path: Path) -> Path:
    """Per-trial validation curves coloured by learning rate; final accuracy vs lr."""
    plt = pyplot()
    from matplotlib import cm, colormaps, colors

    trials = data["trials"]
    lrs = [r["params"]["lr"] for r in trials]
    norm = colors.LogNorm(vmin=min(lrs), vmax=max(lrs))
    cmap = colormaps["viridis"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in trials:
        xs = range(1, len(r["curve"]) + 1)
        style = "-" if r["state"] == "COMPLETE" else ":"
        ax.plot(xs, r["curve"], style, color=cmap(norm(r["params"]["lr"])), lw=1.2, alpha=0.85)
        if r["state"] != "COMPLETE":
            ax.plot([len(r["curve"])], [r["curve"][-1]], "x", color="grey", ms=5)
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation accuracy")
    ax.set_title(f"{len(trials)} trials of {data['task']} (dotted, x: pruned)")
    ax.set_ylim(0, 1)
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="learning rate")
    wds = [max(r["params"].get("weight_decay", 0.0), 1e-12) for r in trials]
    finals = [r["curve"][-1] for r in trials]
    done = [r["state"] == "COMPLETE" for r in trials]
    sc = ax2.scatter(
        lrs,
        finals,
        c=[math.log10(w) for w in wds],
        cmap="plasma",
        marker="o",
        s=[30 if d else 12 for d in done],
    )
    ax2.set_xscale("log")
    ax2.set_xlabel("learning rate")
    ax2.set_ylabel("last validation accuracy")
    ax2.set_ylim(0, 1)
    fig.colorbar(sc, ax=ax2, label="log10 weight decay")
    return save_figure(fig, path)


def write_reports(result: SweepResult, cfg: SweepConfig, task: str, out: Path) -> dict[str, Path]:
    data = to_json(result, cfg, task)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "results.json",
        "markdown": out / "results.md",
        "png": out / "curves.png",
    }
    paths["json"].write_text(json.dumps(data, indent=2))
    paths["markdown"].write_text(markdown(data))
    if data["trials"]:
        plot(data, paths["png"])
    return paths
