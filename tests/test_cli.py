from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from plait.cli import build_parser, main
from tests.bench.test_harness import CONTRACT as HARNESS_FIELDS

CONTRACT = HARNESS_FIELDS | {"torch", "commit", "command"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--strategy", "bogus", "--steps", "1"], "unknown strategy 'bogus'"),
        (["train", "--workload", "alexnet"], "unknown workload"),
        (["bench", "--bandwidth", "warp9", "--strategies", "ssgd"], "invalid rate"),
        (["run", "--nodes", "1"], "give the script"),
    ],
)
def test_bad_input_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_contract_flags_parse() -> None:
    p = build_parser()
    a = p.parse_args(
        [
            "train",
            "--workload",
            "gpt",
            "--strategy",
            "ssgd",
            "--nodes",
            "4",
            "--nproc-per-node",
            "2",
            "--bandwidth",
            "slow",
            "--latency",
            "1ms",
            "--loss",
            "0.1",
            "--steps",
            "5",
            "--trace",
            "t.json",
            "--checkpoint",
            "c",
        ]
    )
    assert (a.nodes, a.nproc_per_node, a.bandwidth, a.steps) == (4, 2, "slow", 5)
    b = p.parse_args(
        [
            "bench",
            "--workload",
            "mlp,gpt",
            "--strategies",
            "ssgd",
            "--bandwidth",
            "slow,fast",
            "--steps",
            "3",
            "--out",
            "x",
        ]
    )
    assert b.nodes == 4 and b.bandwidth == "slow,fast"


def test_bench_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "bench",
        "--workload",
        "mlp",
        "--strategies",
        "ssgd",
        "--nodes",
        "2",
        "--bandwidth",
        "1gbit",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--batch-size",
        "8",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = json.loads((out / "results.json").read_text())
    assert set(rec) >= CONTRACT
    assert rec["bandwidth"] == "1gbit" and rec["nodes"] == 2 and rec["batch_size"] == 8
    assert (out / "results.md").read_text().count("| mlp |") == 1
    assert (out / "results.png").stat().st_size > 1000


def test_train_with_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "train",
        "--workload",
        "mlp",
        "--steps",
        "4",
        "--nodes",
        "2",
        "--trace",
        str(trace),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    cats = {e["cat"] for e in events if e["ph"] == "X"}
    assert {"compute", "comm", "optim"} <= cats


def test_version_flag_and_module_entry_point() -> None:
    import subprocess
    import sys

    from plait import __version__

    out = subprocess.run(
        [sys.executable, "-m", "plait", "--version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"plait {__version__} (torch ")
