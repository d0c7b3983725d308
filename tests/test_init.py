"""`import plait`: cheap, and every entry point and subpackage reachable from it."""

from __future__ import annotations

import subprocess
import sys


def test_import_plait_loads_no_torch_and_reaches_every_entry_point() -> None:
    code = (
        "import sys, plait\n"
        "assert 'torch' not in sys.modules, 'import plait loaded torch'\n"
        "plait.crossover.attach\n"  # was an AttributeError after `import plait`
        "plait.data_parallel\n"
        "assert 'torch._dynamo' not in sys.modules, 'data_parallel pulled in torch._dynamo'\n"
        "plait.fuse, plait.Plan, plait.parallelize, plait.comm.CollectiveError\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
