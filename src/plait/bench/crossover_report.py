"""Reports of co-location comparisons: JSON records, a Markdown table, a bar chart."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plait.bench.records import Comparison
from plait.records import git_commit, machine, pyplot, save_figure, write_report

#: Typed comparisons, or their JSON objects (a results.json read back).
Records = Sequence[Comparison | Mapping[str, Any]]


def typed(records: Records) -> list[Comparison]:
    """`records` as `Comparison`s (JSON objects are converted, so older files render)."""
    return [r if isinstance(r, Comparison) else Comparison.from_dict(r) for r in records]


def markdown(records: Records) -> str:
    """One row per comparison: speed-ups over sequential, the ideal, fairness, CPU busy."""
    head = (
        "| jobs | bandwidth (rate) | alone step s | uncoordinated x seq | crossover x seq | "
        "crossover x uncoord | ideal x seq | crossover slowdown per job | fairness | "
        "CPU busy: alone / uncoord / crossover |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in typed(records):
        un, xo = r.modes.get("uncoordinated"), r.modes["crossover"]
        un_s = f"{un.speedup_vs_sequential:.2f}" if un else "-"
        vs = f"{xo.speedup_vs_sequential / un.speedup_vs_sequential:.2f}" if un else "-"
        rows.append(
            f"| {' + '.join(j.split(':', 1)[1] for j in r.jobs)} | {r.bandwidth} "
            f"({r.rate or 'unshaped'}) | {', '.join(f'{s:.2f}' for s in r.alone_step_s)} | "
            f"{un_s} | {xo.speedup_vs_sequential:.2f} | {vs} | {r.ideal_speedup():.2f} | "
            f"{', '.join(f'{s:.2f}x' for s in xo.slowdown_vs_alone)} | {xo.fairness:.2f} | "
            f"{_busy(r)} |"
        )
    return head + "\n".join(rows) + "\n"


def _busy(record: Comparison) -> str:
    """Host CPU busy fractions inside each measuring window ('-' where not sampled)."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    alone = ", ".join(pct(b) for b in record.alone_cpu_busy or []) or "-"
    modes = record.modes
    un = pct(modes["uncoordinated"].cpu_busy) if "uncoordinated" in modes else "-"
    return f"{alone} / {un} / {pct(modes['crossover'].cpu_busy)}"


def write(records: Records, out: Path, *, command: str) -> dict[str, Path]:
    """results.json (the comparisons with commit, command and machine), results.md and a
    bar chart of the speed-ups in `out`."""
    recs = typed(records)
    # provenance without torch's version, as crossover results have always been written
    commit, mach = git_commit(), machine()
    stamped = [dataclasses.replace(r, commit=commit, command=command, machine=mach) for r in recs]
    return write_report(
        out,
        stamped,
        title="Crossover results",
        command=command,
        body=markdown(recs),
        footer=f"\ncommit {commit}\n",
        plot=lambda path: _plot(recs, path),
    )


def _plot(records: list[Comparison], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(max(5, 2.2 * len(records)), 4))
    labels = ["sequential", "uncoordinated", "crossover", "ideal"]
    colors = ["#999999", "#dd8452", "#4c72b0", "#55a868"]
    width = 0.2
    for k, rec in enumerate(records):
        un = rec.modes.get("uncoordinated")
        xo = rec.modes["crossover"].speedup_vs_sequential
        vals = [1.0, un.speedup_vs_sequential if un else 0.0, xo, rec.ideal_speedup()]
        for j, v in enumerate(vals):
            ax.bar(
                k + (j - 1.5) * width,
                v,
                width,
                color=colors[j],
                label=labels[j] if k == 0 else None,
            )
    ax.set_xticks(range(len(records)))
    ax.set_xticklabels(
        [f"{len(r.jobs)} jobs @ {r.bandwidth}" for r in records], rotation=20, ha="right"
    )
    ax.set_ylabel("aggregate throughput / sequential")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_interleaving(trace: Path, path: Path, *, seconds: float = 8.0) -> Path:
    """Rank 0 of every job in a merged trace: compute and communication on one time axis.

    The picture the method is about: under crossover one job's compute (its token held)
    sits in the other's communication. Without the token, forward and backward stand for
    compute. The window is `seconds` long, centred where all jobs run.
    """
    plt = pyplot()

    from plait.trace import COMM, COMPUTE

    raw = json.loads(trace.read_text())["traceEvents"]
    names = {
        int(e["pid"]) // 1000: e["args"]["name"].rsplit(" rank", 1)[0]
        for e in raw
        if e.get("ph") == "M" and e.get("name") == "process_name" and int(e["pid"]) % 1000 == 0
    }
    events = [e for e in raw if e.get("ph") == "X" and int(e["pid"]) % 1000 == 0]
    gated = any(e["name"] == "hold token" for e in events)
    lanes = {  # label, colour, height: what each span of rank 0 is drawn as
        "hold token": ("compute (token held)", "#4c72b0", 0.7),
        "wait token": ("waiting for the token", "#cccccc", 0.7),
    }

    def lane(e: dict[str, Any]) -> tuple[str, str, float] | None:
        if e["cat"] == COMM:
            return ("communication", "#dd8452", 0.3)
        if gated:
            return lanes.get(e["name"])
        return ("compute", "#4c72b0", 0.7) if e["cat"] == COMPUTE else None

    jobs = sorted({int(e["pid"]) // 1000 for e in events})
    if not jobs:
        raise ValueError(f"{trace} holds no spans of rank 0")
    starts = [min(e["ts"] for e in events if int(e["pid"]) // 1000 == k) for k in jobs]
    ends = [max(e["ts"] + e["dur"] for e in events if int(e["pid"]) // 1000 == k) for k in jobs]
    lo = (max(starts) + min(ends)) / 2 - seconds * 5e5
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.7 * len(jobs)))
    seen: set[str] = set()
    for row, k in enumerate(jobs):
        for e in events:
            style = lane(e)
            if style is None or int(e["pid"]) // 1000 != k:
                continue
            label, color, height = style
            ax.broken_barh(
                [((e["ts"] - lo) / 1e6, e["dur"] / 1e6)],
                (row - height / 2, height),
                color=color,
                zorder=3 if height < 0.5 else 2,
                label=None if label in seen else label,
            )
            seen.add(label)
    ax.set_yticks(range(len(jobs)), [names.get(k, f"job{k}") for k in jobs])
    ax.set_xlim(0, seconds)
    ax.set_xlabel("seconds (rank 0 of each job)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)
    return save_figure(fig, path)
