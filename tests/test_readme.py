"""The README's Python snippets run as written: under torchrun at world size 2 when they
set up a process group, as a plain script otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
DONE = "README-SNIPPET-DONE"


def test_readme_has_snippets() -> None:
    assert len(SNIPPETS) >= 4


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index: int, tmp_path: Path) -> None:
    code = SNIPPETS[index]
    # Each rank reports reaching the end: torch 2.13 sometimes aborts a process at exit
    # after all its work succeeded (see DESIGN.md), so the snippet's own completion is
    # what is judged, on every rank.
    script = tmp_path / "snippet.py"
    script.write_text(code + f"\nprint({DONE!r}, flush=True)\n")
    if "init_process_group" in code:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd = [*launcher, "--nproc-per-node", "2", str(script)]
        ranks = 2
    else:
        cmd = [sys.executable, str(script)]
        ranks = 1
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    log = out.stdout + out.stderr
    assert log.count(DONE) == ranks, f"snippet {index} (exit {out.returncode}):\n{log[-3000:]}"
