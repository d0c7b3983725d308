"""Where a step's time goes: a per-strategy breakdown of a merged `plait bench --trace`.

The harness marks each measured step with ``forward``/``optimizer`` spans that carry the
strategy and phase (``step`` or ``compute-only``); every span that starts inside that window
on the same rank belongs to the step. Per category the breakdown reports the *busy* time,
the union of its spans (collectives in flight overlap one another), averaged over ranks
and steps, next to the step's wall time, so the overlap of communication with computation
shows as busy times summing to more than the step.

    plait bench timeline runs/b/trace_resnet18_fast.json

It prints the table and writes no file.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from plait.bench import suites
from plait.bench.core import Stats
from plait.bench.records import TimelineRow
from plait.flags import option
from plait.trace import COMM, COMPUTE, FACTOR, INVERSE, PRECONDITION

Event = dict[str, Any]

#: (column, predicate on an event) in report order.
COLUMNS: list[tuple[str, Callable[[Event], bool]]] = [
    ("forward+backward", lambda e: e["cat"] == COMPUTE),
    ("factor compute", lambda e: e["cat"] == FACTOR),
    ("factor comm", lambda e: e["cat"] == COMM and e["name"].startswith("factors")),
    ("inverse comm", lambda e: e["cat"] == COMM and e["name"].startswith("inverse")),
    (
        "gradient comm",
        lambda e: e["cat"] == COMM and not e["name"].startswith(("factors", "inverse")),
    ),
    ("inversion", lambda e: e["cat"] == INVERSE),
    ("preconditioning", lambda e: e["cat"] == PRECONDITION),
]


def _union(spans: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _windows(events: list[Event]) -> list[tuple[int, str, str, float, float]]:
    """(rank, strategy, phase, start, end) of every step, from the harness's spans."""
    starts: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    ends: dict[tuple[int, str, str], list[float]] = defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if "strategy" not in args:
            continue
        key = (e["pid"], args["strategy"], args.get("phase", "step"))
        if e["name"] == "forward":
            starts[key].append(e["ts"])
        elif e["name"] == "optimizer":
            ends[key].append(e["ts"] + e["dur"])
    out = []
    for key, ss in starts.items():
        for s, t in zip(sorted(ss), sorted(ends.get(key, [])), strict=False):
            out.append((*key, s, t))
    return out


def _load(path: Path) -> dict[str, Any]:
    """A trace file, gzipped (as committed benchmark traces are) or not."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    out: dict[str, Any] = json.loads(raw)
    return out


def breakdown(trace: str | Path | dict[str, Any]) -> list[TimelineRow]:
    """One row per (strategy, phase): seconds per step of each `COLUMNS` category.

    Means, not medians, over ranks and steps: the busy times of a category add up across
    the step, and a mean keeps that sum (a median of each column would not).
    """
    data = trace if isinstance(trace, dict) else _load(Path(trace))
    events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_rank[e["pid"]].append(e)
    acc: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rank, strategy, phase, start, end in _windows(events):
        inside = [e for e in by_rank[rank] if start <= e["ts"] < end]
        row = acc[(strategy, phase)]
        row["step"].append((end - start) / 1e6)
        for col, pred in COLUMNS:
            spans = [(e["ts"], e["ts"] + e["dur"]) for e in inside if pred(e)]
            row[col].append(_union(spans) / 1e6)
    rows = []
    for (strategy, phase), cols in acc.items():
        step = cols.pop("step")
        rows.append(
            TimelineRow(
                strategy=strategy,
                phase=phase,
                step=Stats.of(step).mean,
                busy={k: Stats.of(v).mean for k, v in cols.items()},
            )
        )
    return rows


def markdown(rows: Sequence[TimelineRow]) -> str:
    """The breakdown as a table: one row per (strategy, phase), seconds per step."""
    names = ["step", *(c for c, _ in COLUMNS)]
    head = "| strategy | phase | " + " | ".join(f"{n} s" for n in names) + " |\n"
    head += "|---|---|" + "---|" * len(names) + "\n"
    body = "".join(
        f"| {r.strategy} | {r.phase} | {r.step:.2f} | "
        + " | ".join(f"{r.busy[c]:.2f}" for c, _ in COLUMNS)
        + " |\n"
        for r in rows
    )
    return head + body


@dataclass(frozen=True, kw_only=True)
class TimelineConfig:
    """The command line of ``plait bench timeline`` (`plait.flags`).

    Attributes:
        trace: a merged ``plait bench --trace`` file (``.json`` or ``.json.gz``).
    """

    trace: str = option(
        MISSING, "a merged plait bench --trace", positional=True, metavar="TRACE.json[.gz]"
    )


def run_parsed(cfg: TimelineConfig, call: suites.Call) -> int:
    """Print the breakdown of the trace (a table on stdout: the suite writes no report)."""
    print(markdown(breakdown(cfg.trace)), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.timeline``: the suite ``timeline`` (`plait.bench.suites`)."""
    return suites.main("timeline", argv)


if __name__ == "__main__":
    sys.exit(main())
