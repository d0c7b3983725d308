"""Benchmark reports: results.json (a record per workload, network, strategy), Markdown, a plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.records import pyplot, save_figure


def markdown_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per record, with ratios to the first strategy of each (workload, bandwidth)."""
    head = (
        "| workload | bandwidth (rate) | strategy | iter s median [min-max] | compute s | "
        "iter/compute | vs first | MB/step | overlap eff. | CPU ms/step (+ over compute) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    base: dict[tuple[str, str], float] = {}
    for r in records:
        key = (r["workload"], r["bandwidth"])
        base.setdefault(key, r["iter_time_s"])
        speed = base[key] / r["iter_time_s"]
        rows.append(
            f"| {r['workload']} | {r['bandwidth']} ({r['rate'] or 'unshaped'}) | "
            f"{r.get('strategy_spec', r['strategy'])} | "
            f"{r['iter_time_s']:.3f} [{r['iter_time_min_s']:.3f}-{r['iter_time_max_s']:.3f}] | "
            f"{r['compute_time_s']:.3f} | {r['iter_time_s'] / r['compute_time_s']:.2f}x | "
            f"{speed:.2f}x | {r['bytes_per_step'] / 1e6:.2f} | {r['overlap_efficiency']:.2f} | "
            f"{_cpu_cell(r)} |"
        )
    return head + "\n".join(rows) + "\n"


def _cpu_cell(r: dict[str, Any]) -> str:
    """Process CPU per step and what the strategy adds to compute-only ("-" if unmeasured)."""
    cpu, comp = r.get("cpu_time_s"), r.get("compute_cpu_time_s")
    if cpu is None or comp is None:
        return "-"
    return f"{cpu * 1e3:.0f} ({(cpu - comp) * 1e3:+.0f})"


def plot(records: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Grouped bars: iteration time per strategy (compute-only as the inner bar)."""
    if not records:
        return None
    plt = pyplot()

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["workload"], r["bandwidth"]), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, ((wl, bw), recs) in zip(axes[0], groups.items(), strict=True):
        names = [r.get("strategy_spec", r["strategy"]) for r in recs]
        xs = range(len(recs))
        it = [r["iter_time_s"] for r in recs]
        lo = [r["iter_time_s"] - r["iter_time_min_s"] for r in recs]
        hi = [r["iter_time_max_s"] - r["iter_time_s"] for r in recs]
        ax.bar(xs, it, color="#4c72b0", label="iteration (median, min-max)", yerr=[lo, hi])
        ax.bar(xs, [r["compute_time_s"] for r in recs], width=0.4, color="#dd8452",
               label="compute only")  # fmt: skip
        ax.set_xticks(list(xs), names, rotation=30, ha="right")
        ax.set_title(f"{wl} @ {bw} ({recs[0]['rate'] or 'unshaped'})")
        ax.set_ylabel("seconds per step")
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, path)


def write_reports(records: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out / "results.json",
        "markdown": out / "results.md",
        "png": out / "results.png",
    }
    paths["json"].write_text(json.dumps(records, indent=2))
    cmd = records[0]["command"] if records else ""
    md = f"# Benchmark results\n\nCommand: `{cmd}`\n\n" + markdown_table(records)
    if records:
        md += f"\ncommit {records[0]['commit']}, torch {records[0]['torch']}, "
        md += f"{records[0]['machine']['cpus']} CPUs ({records[0]['machine']['processor']})\n"
    paths["markdown"].write_text(md)
    plot(records, paths["png"])
    return paths
