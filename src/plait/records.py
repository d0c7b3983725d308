"""Provenance and the one report writer every benchmark and sweep uses.

Each result saved by plait carries where it came from: the git commit (``-dirty`` when
the tree had uncommitted changes), the command, torch's version and the machine
(`stamp`). `write_json` and `write_markdown` put records and their tables on disk; plots
go through `pyplot` (matplotlib on the file-only Agg backend, imported on first use) and
`save_figure`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=False
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    except OSError:
        return "unknown"
    commit = out.stdout.strip() or "unknown"
    return commit + ("-dirty" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def command_line() -> str:
    return " ".join(["plait", *sys.argv[1:]]) if sys.argv else "plait"


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, imported when a plot is drawn (the
    import costs about a second, and most runs never plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, *, dpi: int = 110) -> Path:
    """Lay `fig` out, write it to `path` (creating the folder) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def stamp(records: list[dict[str, Any]], *, command: str | None = None) -> list[dict[str, Any]]:
    """Add torch version, git commit, command and machine to every record."""
    meta = {
        "torch": torch.__version__,
        "commit": git_commit(),
        "command": command or command_line(),
    }
    mach = machine()
    return [{**r, **meta, "machine": mach} for r in records]


def write_json(records: Sequence[Any], path: Path) -> Path:
    """Write `records` (dicts or dataclasses with ``to_dict``) as indented JSON."""
    rows = [r.to_dict() if hasattr(r, "to_dict") else r for r in records]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return path


def write_markdown(text: str, path: Path) -> Path:
    """Write a Markdown report (creating the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path
