"""Refuse early: every command checks all of its input in the parent process.

Each bad input must end in one line on stderr naming the value and what is accepted, exit
code 2 and no traceback, before any namespace, process or temporary file exists: the
cluster, the launcher, subprocesses and temporary directories are all booby-trapped here,
and the working directory must stay empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import plait.bench.colocate  # imported before the traps: it binds `launch` at import
import plait.cluster
import plait.cluster.launch  # the module (trapped below), not the function
from plait import cli
from plait.cli import main
from plait.train.strategy import validate_spec


class Built(AssertionError):
    """Something was created before the input was checked."""


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Fail the test if a cluster, a launch, a subprocess or a temp folder is created."""

    def trap(what: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise Built(f"{what} was called before the input was refused")

        return refuse

    monkeypatch.setattr(plait.cluster.Cluster, "create", trap("Cluster.create"))
    monkeypatch.setattr(plait.cluster, "launch", trap("launch"))
    monkeypatch.setattr(sys.modules["plait.cluster.launch"], "launch", trap("launch"))
    monkeypatch.setattr(subprocess, "Popen", trap("subprocess.Popen"))
    monkeypatch.setattr(tempfile, "mkdtemp", trap("tempfile.mkdtemp"))
    monkeypatch.setattr(tempfile, "mkstemp", trap("tempfile.mkstemp"))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("PLAIT_DEBUG", raising=False)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `plait ARGV` in this process; return its one-line error after checking it."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


JSON_JOB_UNKNOWN_KEY = "job-bad.json"

BAD = [
    # strategy specs and their options
    (
        ["train", "--workload", "mlp", "--strategy", "acpsgd:rnak=4", "--nodes", "2"],
        ["'rnak'", "'acpsgd'", "accepted:", "rank"],
    ),
    (["train", "--strategy", "acpsgd:rank=abc"], ["'abc'", "rank"]),
    (["train", "--strategy", "topk:ratio=5"], ["ratio", "<= 1", "5"]),
    (["train", "--strategy", "ssgd:foo=1"], ["'foo'", "accepted:"]),
    (["train", "--strategy", "spd-kfac:rnak=2"], ["'rnak'", "accepted:"]),
    (["train", "--strategy", "spd-kfac:inv_interval=abc"], ["inv_interval", "'abc'"]),
    (["train", "--strategy", "acpsgd:rank=4,rank=5"], ["'rank'", "twice"]),
    (["train", "--strategy", "bogus"], ["'bogus'", "choose from"]),
    (["train", "--workload", "alexnet"], ["'alexnet'", "choose from"]),
    # cluster flags
    (["train", "--nproc-per-node", "0"], ["--nproc-per-node 0", "from 1 to"]),
    (["train", "--threads", "0"], ["--threads 0", "from 1 to"]),
    (["train", "--nodes", "0"], ["--nodes 0", "1 to 250"]),
    (["train", "--nodes", "100000"], ["--nodes 100000", "1 to 250"]),
    (["train", "--bandwidth", "99999999999999gbit"], ["99999999999999gbit", "1kbit and 1tbit"]),
    (["train", "--bandwidth", "warp9"], ["'warp9'", "100mbit"]),
    (["train", "--bandwidth", "1bit"], ["'1bit'", "1kbit and 1tbit"]),
    (["train", "--latency", "99999s"], ["'99999s'", "at most"]),
    (["train", "--latency", "soon"], ["'soon'", "5ms"]),
    (["train", "--loss", "150"], ["--loss 150", "[0, 100)"]),
    (["train", "--loss", "nan"], ["--loss nan", "[0, 100)"]),
    (["train", "--timeout", "-1"], ["--timeout -1", "from 1 to"]),
    # training flags
    (["train", "--steps", "0"], ["--steps 0", "from 1 to"]),
    (["train", "--epochs", "-1"], ["--epochs -1", "from 1 to"]),
    (["train", "--batch-size", "0"], ["--batch-size 0", "from 1 to"]),
    (["train", "--accumulate", "0"], ["--accumulate 0", "from 1 to"]),
    (["train", "--lr", "-0.1"], ["--lr -0.1", "from 1e-12 to"]),
    (["train", "--max-restarts", "-1"], ["--max-restarts -1", "from 0 to"]),
    (["train", "--crossover", "../etc"], ["'../etc'", "letters"]),
    (["train", "--checkpoint", "{file}/ckpt"], ["--checkpoint", "not a directory"]),
    (["train", "--out", "{file}/x.json"], ["--out", "not a directory"]),
    (["train", "--trace", "{dir}"], ["--trace", "is a directory"]),
    # plans: degrees against the world and the model, sizes
    (["train", "--plan", "dp=3", "--nodes", "2"], ["dp=3", "world size 2"]),
    (["train", "--workload", "gpt", "--plan", "tp=3", "--nodes", "3"], ["tp=3", "heads"]),
    (["train", "--plan", "dp=2,tpp=2", "--nodes", "4"], ["'tpp'", "accepted:"]),
    (["train", "--plan", "auto", "--memory", "2G"], ["'2G'", "2GB", "2GiB"]),
    (["train", "--plan", "auto", "--memory", "lots"], ["'lots'", "512MiB"]),
    # run
    (["run", "--nodes", "2", "--", "no-such-script.py"], ["'no-such-script.py'", "no such file"]),
    (["run", "--nproc-per-node", "0", "--", "{file}"], ["--nproc-per-node 0"]),
    (["run", "-m", "--", "1bad"], ["'1bad'", "dotted module"]),
    (["run", "--nodes", "1"], ["give the script"]),
    # cluster
    (["cluster", "up", "--nodes", "0"], ["--nodes 0"]),
    (["cluster", "up", "--bandwidth", "1e3gbit"], ["'1e3gbit'"]),
    (["cluster", "probe", "--threads", "0"], ["--threads 0"]),
    # bench
    (["bench", "--workload", "mlp", "--strategies", "acpsgd:rnak=4"], ["'rnak'", "accepted:"]),
    (["bench", "--workload", "mlp", "--strategies", "ssgd,topk:ratio=5"], ["ratio", "5"]),
    (["bench", "--workload", "mlp,alexnet"], ["'alexnet'", "choose from"]),
    (["bench", "--bandwidth", "slow,,fast"], ["'slow,,fast'", "empty"]),
    (["bench", "--bandwidth", "slow,warp9"], ["'warp9'"]),
    (["bench", "--steps", "0"], ["--steps 0"]),
    (["bench", "--warmup", "-1"], ["--warmup -1", "from 0 to"]),
    (["bench", "--workload", "gpt", "--strategies", "plan:tp=3"], ["tp=3", "world size 4"]),
    (["bench", "--out", "{file}"], ["--out", "not a directory"]),
    # crossover run
    (["crossover", "run", "mlp/acpsgd:rnak=4", "mlp/ssgd"], ["'rnak'", "accepted:"]),
    (["crossover", "run", "mlp/topk:ratio=5", "mlp/ssgd"], ["ratio", "5"]),
    (["crossover", "run", "mlp/ssgd"], ["1 job", "at least two"]),
    (["crossover", "run", "mlp/ssgd", "no-such.py --lr 1"], ["'no-such.py'", "no such script"]),
    (["crossover", "run", "mlp/ssgd", "{json}"], ["'stepz'"]),
    (["crossover", "run", "mlp/ssgd", "mlp/ssgd", "--nproc-per-node", "0"], ["--nproc-per-node 0"]),
    (
        ["crossover", "run", "mlp/ssgd", "mlp/ssgd", "--compare", "--steps", "3", "--warmup", "3"],
        ["--warmup 3", "--steps 3"],
    ),
    (["crossover", "run", "mlp/ssgd", "mlp/ssgd", "--group", ".."], ["'..'"]),
    (["crossover", "run", "mlp/ssgd", "mlp/ssgd", "--repeats", "0"], ["--repeats 0"]),
    (["crossover", "run", "mlp/ssgd", "gpt/plan:tp=3", "--nodes", "2"], ["tp=3", "world size 2"]),
    # plan
    (["plan", "--memory", "2G"], ["'2G'", "2GB", "2GiB"]),
    (["plan", "--memory=-1GB"], ["'-1GB'"]),
    (["train", "--bandwidth=-5mbit"], ["'-5mbit'"]),
    (["plan", "--nodes", "0"], ["--nodes 0"]),
    (["plan", "--nproc-per-node", "0"], ["--nproc-per-node 0"]),
    (["plan", "--slots", "0"], ["--slots 0"]),
    (["plan", "--bandwidth", "1e99gbit"], ["'1e99gbit'"]),
    (["plan", "--workload", "nope"], ["'nope'", "choose from"]),
    (["plan", "--json", "{file}/t.json"], ["--json", "not a directory"]),
    # sweep
    (["sweep", "--memory-budget", "2G"], ["'2G'", "2GB", "2GiB"]),
    (["sweep", "--memory-budget", "0"], ["'0'", "> 0"]),
    (["sweep", "--trials", "0"], ["--trials 0"]),
    (["sweep", "--epochs", "0"], ["--epochs 0"]),
    (["sweep", "--threads", "0"], ["--threads 0"]),
    (["sweep", "--lr", "1,0.1"], ["--lr", "1.0,0.1", "0 < LO <= HI"]),
    (["sweep", "--lr", "a,b"], ["'a,b'", "numbers"]),
    (["sweep", "--batch-sizes", "0"], ["--batch-sizes 0"]),
    (["sweep", "--device", "tpu"], ["'tpu'", "cpu, cuda"]),
    (["sweep", "--device", "cuda:99"], ["'cuda:99'", "CUDA device"]),
    (["sweep", "--storage", "runs.db"], ["--storage", "sqlite:///"]),
    (["sweep", "--task", "imagenet"], ["'imagenet'", "digits-cnn"]),
    (["sweep", "--out", "{file}"], ["--out", "not a directory"]),
    # bench-fused
    (["bench-fused", "--models", "mlp,nope"], ["'nope'", "choose from"]),
    (["bench-fused", "--n", "0"], ["--n 0"]),
    (["bench-fused", "--threads", "0"], ["--threads 0"]),
    (["bench-fused", "--strategies", "fused,bogus"], ["'fused,bogus'", "serial"]),
    (["bench-fused", "--steps", "0"], ["--steps 0"]),
    (["bench-fused", "--device", "gpu"], ["'gpu'"]),
    # numbers that used to pass the checks and fail later (or never end): one bounds table
    (["train", "--out", "/proc/plait.json"], ["--out", "/proc", "cannot be created"]),
    (["train", "--seed", "99999999999999999999999"], ["--seed", "9223372036854775807"]),
    (["train", "--lr", "1e308"], ["--lr 1e+308", "expected a number"]),
    (["train", "--momentum", "1e300"], ["--momentum 1e+300", "from 0 to 1"]),
    (["train", "--batch-size", "1000000000"], ["--batch-size 1000000000", "from 1"]),
    (["train", "--batch-size", "5000", "--nodes", "2"], ["10000 samples", "1438", "at most"]),
    (["train", "--steps", "100000000000000000000000"], ["--steps", "10000000"]),
    (["train", "--timeout", "1e308"], ["--timeout 1e+308"]),
    (["train", "--timeout", "1e-9"], ["--timeout 1e-09"]),
    (["train", "--nproc-per-node", "100000"], ["--nproc-per-node 100000", "256"]),
    (["train", "--threads", "1000000"], ["--threads 1000000", "1024"]),
    (["run", "--max-restarts", "99999999999", "--", "x.py"], ["--max-restarts", "100"]),
    (["bench", "--warmup", "100000000000"], ["--warmup 100000000000"]),
    (["sweep", "--trials", "100000000000000000000"], ["--trials", "1000000"]),
    (["sweep", "--seed", "-5"], ["--seed -5", "from 0"]),
    (["train", "--latency", "-5ms"], ["'-5ms'", "latency"]),
    (["plan", "--memory", "-5GiB"], ["'-5GiB'", "size"]),
    (["bench-fused", "--threads", "1,1000000"], ["--threads 1000000"]),
    # demo
    (["demo", "--nodes", "0"], ["--nodes 0"]),
    (["demo", "--out", "{file}/demo"], ["--out", "not a directory"]),
]


@pytest.mark.parametrize(("argv", "needles"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_refused_before_anything_is_built(
    argv: list[str],
    needles: list[str],
    nothing_built: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    job = tmp_path / JSON_JOB_UNKNOWN_KEY
    job.write_text(json.dumps({"workload": "mlp", "stepz": 3}))
    argv = [a.format(file=file, dir=tmp_path, json=job) for a in argv]
    line = _refused(argv, capsys)
    assert line.startswith("plait "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert list(nothing_built.iterdir()) == []  # not even runs/


def test_debug_shows_the_traceback(nothing_built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--debug", "train", "--strategy", "acpsgd:rnak=4"],
        ["train", "--strategy", "acpsgd:rnak=4", "--debug"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert "Traceback" in err and "'rnak'" in err.splitlines()[-1]


def test_unexpected_errors_are_one_line_with_exit_1(
    monkeypatch: pytest.MonkeyPatch, nothing_built: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: Any) -> int:
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setitem(cli.COMMANDS, "plan", broken)
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--workload", "mlp"])
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert err.strip() == "plait plan: error: RuntimeError: disk on fire second line"
    with pytest.raises(SystemExit):
        main(["plan", "--workload", "mlp", "--debug"])
    assert "Traceback" in capsys.readouterr().err


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--nodes", "two"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "'two'" in err


@pytest.mark.parametrize(
    ("spec", "needles"),
    [
        ("acpsgd:rnak=4", ["unknown option 'rnak' for strategy 'acpsgd'", "rank", "warmup"]),
        ("powersgd:rank=0", ["'powersgd'", "rank", "> 0"]),
        ("torch-powersgd:rank=2.5", ["rank", "integer"]),
        ("ssgd:bucket_cap_mb=abc", ["bucket_cap_mb", "'abc'"]),
        # its hook runs in one bucket: a bucket size would be silently ignored
        ("torch-powersgd:rank=4,bucket_cap_mb=2", ["one DDP bucket", "bucket_cap_mb"]),
        ("fp16:x=1", ["'x'", "'fp16'"]),
        ("kfac-naive:compression=zip", ["'zip'", "choose from"]),
        ("spd-kfac:compression=acpsgd,rnak=4", ["'rnak'", "rank"]),
        ("spd-kfac:include_factors=maybe", ["include_factors", "'maybe'"]),
        ("plan:dp=2,tpp=2", ["'tpp'", "accepted:"]),
        ("plan:tp=true", ["tp", "integer"]),
        ("plan:auto=true,memory=2G", ["'2G'", "ambiguous"]),
        ("plan:auto=abc", ["auto", "'abc'"]),
    ],
)
def test_validate_spec_is_strict(spec: str, needles: list[str]) -> None:
    with pytest.raises(ValueError) as exc:
        validate_spec(spec)
    for needle in needles:
        assert needle in str(exc.value)


@pytest.mark.parametrize(
    "spec",
    [
        "ssgd",
        "acpsgd:rank=4,warmup=10",
        "topk:ratio=0.05",
        "spd-kfac:compression=acpsgd,rank=2",
        "ssgd:bucket_cap_mb=10,final_bucket_mb=1",
        "plan:dp=2,tp=2",
        "plan:auto=true,memory=2GiB",
    ],
)
def test_validate_spec_accepts_good_specs(spec: str) -> None:
    validate_spec(spec)


def test_the_command_line_prints_one_line(tmp_path: Path) -> None:
    """End to end in a fresh interpreter: one stderr line, exit 2, no cluster."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RANK", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "train",
            "--workload",
            "mlp",
            "--strategy",
            "acpsgd:rnak=4",
            "--nodes",
            "2",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "plait train: error: unknown option 'rnak' for strategy 'acpsgd' (accepted: "
        "bucket_cap_mb, final_bucket_mb, find_unused_parameters, gradient_as_bucket_view, "
        "layer_ranks, min_compression_rate, rank, seed, warmup)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_foreign_token_folder_is_refused_before_the_cluster(
    nothing_built: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Another user's (here: a link's) crossover token folder used to be found only by the
    workers, after the namespaces existed."""
    root, target = tmp_path / "tokens", tmp_path / "elsewhere"
    root.mkdir()
    target.mkdir(mode=0o700)
    (root / f"plait-crossover-{os.getuid()}").symlink_to(target)
    monkeypatch.setenv("PLAIT_TOKEN_DIR", str(root))
    for argv in (
        ["train", "--workload", "mlp", "--crossover", "g", "--nodes", "2"],
        ["crossover", "run", "mlp/ssgd", "mlp/ssgd", "--nodes", "2"],
    ):
        line = _refused(argv, capsys)
        assert "symbolic link" in line and "PLAIT_TOKEN_DIR" in line, line
