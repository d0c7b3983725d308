"""The planner's scorecard: was its choice the measured-fastest plan that fits?

Reads benchmark records (`plait bench` results with explicit ``plan:...`` strategies and
``plan:auto=true[,memory=M]`` ones, side by side in one job) and the measured memory per
plan (`plait.bench.membench`). For every (workload, network, memory budget) setting it
compares the automatic plan's measured iteration time with the fastest explicit plan whose
*measured* peak fits the budget, and checks the chosen plan's own measured peak against
the budget. The choice counts as right when it *is* the fastest fitting plan, or when its
time is within 10% of that plan's. Its time is the median of every step measured of it:
the automatic run's and, when the same plan also ran explicitly, that run's (two
measurements of one plan in one job differ only by the machine's noise)::

    plait bench scorecard RESULTS.json... --memory MEMORY.json... --out FILE.md

The report is `plait.records.write_report`'s, named after ``--out``: ``FILE.md`` and
``FILE.json`` in its folder.
"""

from __future__ import annotations

import json
import sys
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from plait.bench import suites
from plait.bench.core import Stats
from plait.bench.records import MemoryRecord, ScoreRow
from plait.flags import option
from plait.parallel.memory import format_bytes, parse_bytes
from plait.records import write_report

#: The choice counts as right within this factor of the fastest fitting plan.
TOLERANCE = 1.10


def _plan(desc: str) -> str:
    return desc.removeprefix("plan:")


def _budget(spec: str) -> int | None:
    for item in spec.partition(":")[2].split(","):
        key, _, value = item.partition("=")
        if key == "memory":
            return parse_bytes(value)
    return None


def score(records: list[dict[str, Any]], peaks: dict[str, int]) -> list[ScoreRow]:
    """One row per automatic plan record (see the module docstring)."""
    rows: list[ScoreRow] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["workload"], r["bandwidth"]), []).append(r)
    for (workload, bandwidth), recs in groups.items():
        explicit = [r for r in recs if not r["strategy_spec"].startswith("plan:auto")]
        for auto in (r for r in recs if r["strategy_spec"].startswith("plan:auto")):
            budget = _budget(auto["strategy_spec"])
            fitting = [
                r
                for r in explicit
                if budget is None or peaks.get(_plan(r["strategy_desc"]), 1 << 62) <= budget
            ]
            best = min(fitting, key=lambda r: r["iter_time_s"])
            chosen = _plan(auto["strategy_desc"])
            peak = peaks.get(chosen)
            same = [r for r in explicit if _plan(r["strategy_desc"]) == chosen]
            steps = [t for r in [auto, *same] for t in r.get("iter_times_s", [r["iter_time_s"]])]
            pooled = Stats.of(steps).median
            ratio = pooled / best["iter_time_s"]
            is_fastest = chosen == _plan(best["strategy_desc"])
            rows.append(
                ScoreRow(
                    workload=workload,
                    bandwidth=bandwidth,
                    memory_budget=budget,
                    chosen=chosen,
                    chosen_iter_s=auto["iter_time_s"],
                    chosen_pooled_iter_s=pooled,
                    fastest_fitting=_plan(best["strategy_desc"]),
                    fastest_iter_s=best["iter_time_s"],
                    auto_ratio=auto["iter_time_s"] / best["iter_time_s"],
                    ratio=ratio,
                    is_fastest=is_fastest,
                    within_tolerance=is_fastest or ratio <= TOLERANCE,
                    chosen_peak_bytes=peak,
                    fits_measured=None if peak is None else budget is None or peak <= budget,
                    candidates_fitting=len(fitting),
                    candidates=len(explicit),
                )
            )
    return rows


def markdown(rows: list[ScoreRow]) -> str:
    lines = [
        "| workload | network | memory budget | planner's choice | its s/step (auto run; all "
        "its runs) | fastest fitting plan (of) | its s/step | ratio (auto run; all) | right "
        "| choice's measured peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = "none" if r.memory_budget is None else format_bytes(r.memory_budget)
        peak = r.chosen_peak_bytes
        fits = "not measured" if peak is None else format_bytes(peak)
        if peak is not None and r.memory_budget is not None:
            fits += " (fits)" if r.fits_measured else " (**over**)"
        verdict = "no"
        if r.within_tolerance:
            verdict = "yes: the fastest" if r.is_fastest else "yes: within 10%"
        lines.append(
            f"| {r.workload} | {r.bandwidth} | {budget} | `{r.chosen}` | "
            f"{r.chosen_iter_s:.3f}; {r.chosen_pooled_iter_s:.3f} | "
            f"`{r.fastest_fitting}` ({r.candidates_fitting}/{r.candidates}) | "
            f"{r.fastest_iter_s:.3f} | {r.auto_ratio:.2f}; {r.ratio:.2f} | {verdict} | "
            f"{fits} |"
        )
    hits = sum(r.within_tolerance for r in rows)
    over = sum(r.fits_measured is False for r in rows)
    lines.append("")
    lines.append(
        f"The fastest fitting plan or within 10% of it in {hits} of {len(rows)} settings "
        f"({100 * hits / max(1, len(rows)):.0f}%); choices over their memory budget: {over}."
    )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True)
class ScorecardConfig:
    """The command line of ``plait bench scorecard`` (its flags, `plait.flags`).

    Attributes:
        results: ``plait bench`` ``results.json`` files, explicit and automatic plans.
        memory: `plait.bench.membench` ``memory.json`` files of the same plans.
        out: where to write the Markdown report, ``DIR/NAME.md`` (and its JSON beside it,
            ``DIR/NAME.json``); default: none.
    """

    results: tuple[str, ...] = option(
        MISSING, "plait bench results.json files", positional=True, nargs="+"
    )
    memory: tuple[str, ...] = option(MISSING, "membench memory.json files", nargs="+")
    out: str | None = option(None, "write the Markdown report here (NAME.md), its JSON beside it")


def run_parsed(cfg: ScorecardConfig, call: suites.Call) -> int:
    """Score every automatic plan, print the table and, with ``--out``, write the report."""
    records = [r for path in cfg.results for r in json.loads(Path(path).read_text())]
    peaks = {
        m.plan: max(m.peak_bytes)
        for path in cfg.memory
        for m in map(MemoryRecord.from_dict, json.loads(Path(path).read_text()))
    }
    rows = score(records, peaks)
    text = markdown(rows)
    print(text)
    if cfg.out:
        out = Path(cfg.out)
        write_report(
            out.parent,
            rows,
            title="The planner's scorecard",
            command=call.command,
            body=text,
            indent=2,
            stem=out.stem,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.scorecard``: the suite ``scorecard`` (`plait.bench.suites`)."""
    return suites.main("scorecard", argv)


if __name__ == "__main__":
    sys.exit(main())
