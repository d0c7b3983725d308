"""Benchmark reports: results.json (a record per workload, network, strategy), Markdown, a plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plait.bench.records import BenchRecord
from plait.records import pyplot, save_figure, write_report

#: Typed records, or their JSON objects (a results.json read back).
Records = Sequence[BenchRecord | Mapping[str, Any]]


def typed(records: Records) -> list[BenchRecord]:
    """`records` as `BenchRecord`s (JSON objects are converted, so older files render)."""
    return [r if isinstance(r, BenchRecord) else BenchRecord.from_dict(r) for r in records]


def markdown_table(records: Records) -> str:
    """One row per record, with ratios to the first strategy of each (workload, bandwidth)."""
    head = (
        "| workload | bandwidth (rate) | strategy | iter s median [min-max] | compute s | "
        "iter/compute | vs first | MB/step | overlap eff. | CPU ms/step (+ over compute) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    base: dict[tuple[str, str], float] = {}
    for r in typed(records):
        key = (r.workload, r.bandwidth)
        base.setdefault(key, r.iter_time_s)
        speed = base[key] / r.iter_time_s
        rows.append(
            f"| {r.workload} | {r.bandwidth} ({r.rate or 'unshaped'}) | {r.strategy_spec} | "
            f"{r.iter_time_s:.3f} [{r.iter_time_min_s:.3f}-{r.iter_time_max_s:.3f}] | "
            f"{r.compute_time_s:.3f} | {r.iter_time_s / r.compute_time_s:.2f}x | "
            f"{speed:.2f}x | {r.bytes_per_step / 1e6:.2f} | {r.overlap_efficiency:.2f} | "
            f"{_cpu_cell(r)} |"
        )
    return head + "\n".join(rows) + "\n"


def _cpu_cell(r: BenchRecord) -> str:
    """Process CPU per step and what the strategy adds to compute-only ("-" if unmeasured)."""
    cpu, comp = r.cpu_time_s, r.compute_cpu_time_s
    if cpu is None or comp is None:
        return "-"
    return f"{cpu * 1e3:.0f} ({(cpu - comp) * 1e3:+.0f})"


def plot(records: Records, path: Path) -> Path | None:
    """Grouped bars: iteration time per strategy (compute-only as the inner bar)."""
    if not records:
        return None
    plt = pyplot()

    groups: dict[tuple[str, str], list[BenchRecord]] = {}
    for r in typed(records):
        groups.setdefault((r.workload, r.bandwidth), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, ((wl, bw), recs) in zip(axes[0], groups.items(), strict=True):
        xs = range(len(recs))
        it = [r.iter_time_s for r in recs]
        lo = [r.iter_time_s - r.iter_time_min_s for r in recs]
        hi = [r.iter_time_max_s - r.iter_time_s for r in recs]
        ax.bar(xs, it, color="#4c72b0", label="iteration (median, min-max)", yerr=[lo, hi])
        compute = [r.compute_time_s for r in recs]
        ax.bar(xs, compute, width=0.4, color="#dd8452", label="compute only")
        ax.set_xticks(list(xs), [r.strategy_spec for r in recs], rotation=30, ha="right")
        ax.set_title(f"{wl} @ {bw} ({recs[0].rate or 'unshaped'})")
        ax.set_ylabel("seconds per step")
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, path)


def write_reports(records: Records, out: Path) -> dict[str, Path]:
    """results.json, results.md and results.png of stamped records in `out`."""
    recs = typed(records)
    footer = ""
    if recs:
        first = recs[0]
        mach = first.machine or {}
        footer = (
            f"\ncommit {first.commit}, torch {first.torch}, "
            f"{mach.get('cpus')} CPUs ({mach.get('processor')})\n"
        )
    return write_report(
        out,
        recs,
        title="Benchmark results",
        command=(recs[0].command or "") if recs else "",
        body=markdown_table(recs),
        footer=footer,
        plot=lambda path: plot(recs, path),
    )
