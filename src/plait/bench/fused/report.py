"""Reports of the fused-array benchmark: results.json, a Markdown table, a PNG plot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plait.bench.fused.strategies import ArrayStrategy
from plait.bench.records import FusedRecord
from plait.records import pyplot, save_figure, stamp, write_report

#: Typed records, or their JSON objects (a results.json read back).
Records = Sequence[FusedRecord | Mapping[str, Any]]


def typed(records: Records) -> list[FusedRecord]:
    """`records` as `FusedRecord`s (JSON objects are converted, so older files render)."""
    return [r if isinstance(r, FusedRecord) else FusedRecord.from_dict(r) for r in records]


def _strategies(records: Sequence[FusedRecord]) -> list[str]:
    """The strategies present, in `ArrayStrategy`'s order whatever the records' order."""
    present = {r.strategy for r in records}
    return [s.value for s in ArrayStrategy if s.value in present]


def _by(records: Sequence[FusedRecord]) -> dict[tuple[str, int, int], dict[str, FusedRecord]]:
    """Records per (model, N, threads), rows ordered by model (as first seen), N, threads."""
    models = list(dict.fromkeys(r.workload for r in records))
    out: dict[tuple[str, int, int], dict[str, FusedRecord]] = {}
    for r in sorted(records, key=lambda r: (models.index(r.workload), r.n, r.threads)):
        out.setdefault((r.workload, r.n, r.threads), {})[r.strategy] = r
    return out


def _best(records: Sequence[FusedRecord]) -> dict[tuple[str, int], dict[str, FusedRecord]]:
    """Per model and N, each strategy's record at its fastest thread count."""
    out: dict[tuple[str, int], dict[str, FusedRecord]] = {}
    for (model, n, _), recs in _by(records).items():
        slot = out.setdefault((model, n), {})
        for r in recs.values():
            old = slot.get(r.strategy)
            if old is None or r.iter_time_s < old.iter_time_s:
                slot[r.strategy] = r
    return out


def _ratio(recs: dict[str, FusedRecord], other: str, *, cpu: bool = True) -> str:
    fused = recs.get("fused")
    if fused is None or other not in recs:
        return "-"
    wall = recs[other].iter_time_s / fused.iter_time_s
    if not cpu:
        return f"{wall:.2f}x"
    work = recs[other].cpu_time_s / fused.cpu_time_s
    return f"{wall:.2f}x [{work:.2f}x]"


def markdown_table(records: Records) -> str:
    """Wall-clock throughput (samples/s) per strategy and the fused array's speed-ups
    (wall clock, and CPU time in brackets), per model, N and thread count; with several
    thread counts, a second table compares every strategy at its own fastest count."""
    records = typed(records)
    strategies = _strategies(records)
    others = [s for s in ("serial", "vmap", "concurrent") if s in strategies]
    ratios = " | ".join(f"fused vs {s} wall [CPU]" for s in others)
    rule = "|---" * (len(strategies) + len(others) + 3) + "|\n"
    head = (
        "| model | N | threads | "
        + " | ".join(f"{s} samples/s" for s in strategies)
        + f" | {ratios} |\n"
        + rule
    )
    rows = []
    for (model, n, threads), recs in _by(records).items():
        cells = [f"{recs[s].throughput:.0f}" if s in recs else "-" for s in strategies]
        rows.append(
            f"| {model} | {n} | {threads} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(_ratio(recs, s) for s in others)
            + " |"
        )
    md = head + "\n".join(rows) + "\n"
    if len({r.threads for r in records}) < 2:
        return md
    # CPU times of different thread counts do not compare: wall-clock ratios only
    md += (
        "\nEach strategy at its fastest thread count (samples/s @ threads):\n\n"
        "| model | N | "
        + " | ".join(strategies)
        + " | "
        + " | ".join(f"fused vs {s} wall" for s in others)
        + " |\n"
        + "|---" * (len(strategies) + len(others) + 2)
        + "|\n"
    )
    for (model, n), recs in _best(records).items():
        cells = [
            f"{recs[s].throughput:.0f} @ {recs[s].threads}" if s in recs else "-"
            for s in strategies
        ]
        md += (
            f"| {model} | {n} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(_ratio(recs, s, cpu=False) for s in others)
            + " |\n"
        )
    return md


def plot(records: Records, path: Path) -> Path:
    """Throughput against N, one column per model, one line per strategy and thread count
    (colour: strategy; style: thread count); the top row by wall clock, the bottom row per
    CPU second (the load-robust measure)."""
    records = typed(records)
    plt = pyplot()

    models = list(dict.fromkeys(r.workload for r in records))
    strategies = _strategies(records)  # colour per strategy
    counts = sorted({r.threads for r in records})  # line style per thread count
    fig, axes = plt.subplots(2, len(models), figsize=(4.6 * len(models), 7.5), squeeze=False)
    for col, model in enumerate(models):
        recs = [r for r in records if r.workload == model]
        for row, (key, label) in enumerate(
            [("throughput", "samples / s (wall clock)"), ("cpu_throughput", "samples / CPU s")]
        ):
            ax = axes[row][col]
            pairs = {(r.strategy, r.threads) for r in recs}
            for s, t in sorted(pairs, key=lambda p: (strategies.index(p[0]), p[1])):
                pts = sorted(
                    (r.n, getattr(r, key)) for r in recs if r.strategy == s and r.threads == t
                )
                style = ("o-", "s--", "^:", "d-.")[counts.index(t) % 4]
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    color=f"C{strategies.index(s)}",
                    label=f"{s} ({t}t)",
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("models N")
            ax.set_ylabel(label)
            ax.set_title(model)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, path)


def _footer(records: Sequence[FusedRecord]) -> str:
    """The line under the tables: provenance and the settings every record shares."""
    if not records:
        return ""
    first = records[0]
    mach = first.machine or {}
    return (
        f"\ncommit {first.commit}, torch {first.torch}, {mach.get('cpus')} CPUs "
        f"({mach.get('processor')}), device {first.device}, "
        f"intra-op threads per process as in the tables, glibc malloc thresholds "
        f"{'raised' if first.malloc_tuned else 'default'}, stock Adam "
        f"{first.stock_adam or 'for-loop'}, plait's native kernels "
        f"{'on' if first.native_kernels else 'off'}, fused convolutions "
        f"{first.conv_layout or 'nchw'}\n"
    )


def markdown_report(records: Records) -> str:
    """results.md of stamped records: the command, the tables and the machine."""
    recs = typed(records)
    command = (recs[0].command or "") if recs else ""
    return (
        f"# Fused-array throughput\n\nCommand: `{command}`\n\n"
        + markdown_table(recs)
        + _footer(recs)
    )


def write_reports(records: Records, out: Path) -> dict[str, Path]:
    """Stamp records (commit, command, machine) and write results.json/.md/.png."""
    recs = stamp(typed(records))
    return write_report(
        out,
        recs,
        title="Fused-array throughput",
        command=(recs[0].command or "") if recs else "",
        body=markdown_table(recs),
        footer=_footer(recs),
        plot=lambda path: plot(recs, path) if recs else None,
    )
