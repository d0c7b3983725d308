"""Temporary folders go when the command ends, however it ends, unless kept for a report."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plait._proc import temp_dir

SCRIPT = textwrap.dedent(
    """
    import sys
    from plait._proc import keep_scratch, scratch_dir
    gone, kept = scratch_dir("plait-train-"), scratch_dir("plait-bench-")
    (gone / "config.json").write_text("{}")
    keep_scratch(kept)
    print(gone, kept, flush=True)
    if sys.argv[1] == "raise":
        raise KeyboardInterrupt
    """
)


@pytest.mark.parametrize("how", ["return", "raise"])
def test_scratch_dirs_are_removed_at_exit_unless_kept(how: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, check=False
    )
    gone, kept = (Path(p) for p in done.stdout.split())
    try:
        assert not gone.exists()
        assert kept.is_dir()
        assert "kept" in done.stderr or done.returncode != 0
        assert (kept / ".kept").is_file()  # the next command's sweep leaves it alone
    finally:
        shutil.rmtree(kept)


def test_temp_dir_kept_only_on_error_when_asked() -> None:
    with temp_dir("plait-probe-") as p:
        (p / "x").write_text("1")
    assert not p.exists()
    with pytest.raises(RuntimeError), temp_dir("plait-probe-", keep_on_error=True) as q:
        raise RuntimeError
    assert q.is_dir()
    (q).rmdir()
