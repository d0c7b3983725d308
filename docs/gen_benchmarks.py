"""Benchmark pages, built from benchmarks/ at build time.

- The Markdown reports and pictures of benchmarks/ appear under benchmarks/ in the site,
  so RESULTS.md and the guides link to them by the same relative paths as in the
  repository, and the strict build checks those links and anchors.
- Every folder gets an index page listing its reports, so folder links resolve.
- results.md is the summary table that opens benchmarks/RESULTS.md, its links rebased.
"""

from __future__ import annotations

import re
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
COPIED = {".md", ".png", ".svg"}
LINK = re.compile(r"(\]\()([^)\s]+)(\))")

for path in sorted(BENCH.rglob("*")):
    if path.is_file() and path.suffix in COPIED:
        rel = path.relative_to(ROOT).as_posix()
        with mkdocs_gen_files.open(rel, "wb") as fh:
            fh.write(path.read_bytes())
        if path.suffix == ".md":
            mkdocs_gen_files.set_edit_path(rel, rel)

for folder in sorted([BENCH, *(p for p in BENCH.rglob("*") if p.is_dir())]):
    if (folder / "index.md").exists():
        continue
    rel = folder.relative_to(ROOT).as_posix()
    lines = [f"# `{rel}/`\n"]
    if folder == BENCH:
        lines.append("The summary and the full history are in [RESULTS.md](RESULTS.md).\n")
    subdirs = sorted(p for p in folder.iterdir() if p.is_dir())
    reports = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in COPIED)
    others = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix not in COPIED)
    for sub in subdirs:
        lines.append(f"- [`{sub.name}/`]({sub.name}/index.md)")
    for report in reports:
        lines.append(f"- [`{report.name}`]({report.name})")
    if others:
        lines.append(
            "\nIn the repository only (raw records and traces): "
            + ", ".join(f"`{p.name}`" for p in others)
        )
    with mkdocs_gen_files.open(f"{rel}/index.md", "w") as fh:
        fh.write("\n".join(lines) + "\n")


def summary_section(text: str) -> str:
    """The lines after '## Summary' up to the next second-level heading."""
    lines = text.splitlines()
    start = lines.index("## Summary") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("## "))
    return "\n".join(lines[start:end]).strip() + "\n"


def rebase(match: re.Match[str]) -> str:
    target = match.group(2)
    if "://" in target:
        return match.group(0)
    target = f"benchmarks/RESULTS.md{target}" if target.startswith("#") else f"benchmarks/{target}"
    return f"{match.group(1)}{target}{match.group(3)}"


results = (BENCH / "RESULTS.md").read_text(encoding="utf-8")
with mkdocs_gen_files.open("results.md", "w") as fh:
    fh.write(
        "# Benchmark results\n\n"
        "What each system achieved on the [emulated cluster](cluster.md), measured as the "
        "[benchmark protocol](protocol.md) prescribes. This is the summary that opens "
        "[benchmarks/RESULTS.md](benchmarks/RESULTS.md), copied from it at build time; the "
        "raw records (`results.json`) stay in the repository beside each report.\n\n"
        + LINK.sub(rebase, summary_section(results))
    )
mkdocs_gen_files.set_edit_path("results.md", "benchmarks/RESULTS.md")
