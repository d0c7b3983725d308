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


def test_the_command_lines_parser_loads_no_torch() -> None:
    """``plait --help`` (and every parse) builds all commands' flags: torch's import
    (1.3 s of the 2.5 s ``--help`` took) is left to the command that runs. The lazy names
    of `plait.train` still resolve."""
    code = (
        "import sys\n"
        "from plait.cli import build_parser\n"
        "parser = build_parser()\n"
        "parser.parse_args(['train', '--workload', 'mlp'])\n"
        "assert 'torch' not in sys.modules, 'the parser loaded torch'\n"
        "import plait.train\n"
        "assert 'torch' not in sys.modules, 'plait.train loaded torch'\n"
        "plait.train.Trainer, plait.train.make_strategy, plait.train.Checkpointer\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
