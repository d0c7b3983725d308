"""The GPU suite: every measurement a lent GPU should give, in one prepared command.

A GPU machine is lent here for minutes, bare (Python with torch, the repository, no plait
install and nothing to download), so the suite is one command that runs the parts below
one after another, each in its own process under a deadline, writes everything under one
folder (and a ``.tar.gz`` of it beside it, one file to bring back), and never stops at a
failed part: each part's exit code, time and log tail are recorded in ``suite.json``.

Parts, on ``--device cuda``:

1. ``fused``: HFTA's own comparison, fused arrays against serial training, vmap and
   concurrent processes, N = 1..64, for the MLP, the CNN and the Transformer
   (``plait bench-fused``; the concurrent processes only to N = 16, since 64 CUDA contexts
   would take the GPU's memory and the suite's minutes).
2. ``kfac``: a K-FAC step (expand and reduce factors, inverses every step and every 100)
   against SGD, AdamW and Muon steps (`plait.bench.kfac_cuda`).
3. ``dp``: the data-parallel strategies with 4 ranks on the one GPU (they share it and talk
   through gloo) at ``slow`` and ``fast`` (``plait bench --device cuda``): shaped by tc
   where the machine allows namespaces, else by the modelled link (`plait.comm.link`).
4. ``crossover``: two co-located jobs on the GPU, alone, uncoordinated and with crossover
   (``plait crossover run --compare``; the dry run co-locates them under the token once).

``--dry-run`` runs the same parts small, on the CPU, in under a minute: the test suite runs
it, so the command a lent machine gets has run before it gets there.

    plait bench gpu-suite [--out DIR] [--dry-run] [--budget-s 540]
    python -m plait.bench.gpu_suite ...   # the same, where plait is not installed
    make gpu-suite            # on the lent machine: PYTHONPATH=src, results in runs/gpu-suite

Unlike the other suites it writes no ``results.*`` report of its own: its folder holds one
folder per part (each part's own report), the parts' logs, ``suite.json`` (every part's
command, exit code, time and log tail) and ``README.md`` (the summary).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plait.bench import suites
from plait.flags import option

#: The whole suite's wall-clock budget (seconds): 9 minutes of a lent machine's 15, which
#: leaves its start, the transfer of the tree and of the results, and a rerun of one part.
DEFAULT_BUDGET_S = 540.0


@dataclass(frozen=True, kw_only=True)
class Part:
    """One measurement: a command, its share of the budget and where it writes.

    Attributes:
        name: folder under the suite's output, and the key in ``suite.json``.
        argv: arguments after ``python -m`` (a module and its flags); ``{out}`` is
            replaced by the part's folder.
        budget_s: the most seconds it may take (less when the suite's time runs out).
        what: one line for the summary.
    """

    name: str
    argv: tuple[str, ...]
    budget_s: float
    what: str


def _fused(name: str, flags: str, device: str, budget_s: float, what: str) -> Part:
    """A ``plait bench-fused`` part over HFTA's three models; `flags` as typed."""
    return Part(
        name=name,
        argv=(
            "plait.cli",
            "bench-fused",
            "--workload",
            "mlp,cnn,transformer",
            *flags.split(),
            "--device",
            device,
            "--out",
            "{out}",
        ),
        budget_s=budget_s,
        what=what,
    )


def parts(*, dry_run: bool = False) -> list[Part]:
    """The suite's parts, full size on CUDA or small on the CPU (`dry_run`)."""
    device = "cpu" if dry_run else "cuda"
    if dry_run:
        fused = [
            _fused(
                "fused",
                "--n 2 --strategies fused,serial,vmap,concurrent --steps 1 --rounds 1 --warmup 0",
                device,
                40,
                "fused arrays vs serial, vmap and concurrent processes",
            )
        ]
    else:
        fused = [
            _fused(
                "fused",
                "--n 1,2,4,8,16,32,64 --strategies fused,serial,vmap --steps 5 --rounds 3 "
                "--warmup 2",
                device,
                150,
                "fused arrays vs serial and vmap, N = 1..64",
            ),
            _fused(
                "fused-concurrent",
                "--n 1,4,16 --strategies fused,serial,concurrent --steps 5 --rounds 2 --warmup 2",
                device,
                80,
                "fused arrays vs concurrent processes (MPS-less sharing), N = 1, 4, 16",
            ),
        ]
    kfac = Part(
        name="kfac",
        argv=(
            "plait.bench.kfac_cuda",
            "--workload",
            "digits-cnn" if dry_run else "resnet18",
            "--batch",
            "8" if dry_run else "128",
            "--steps",
            "2" if dry_run else "20",
            "--warmup",
            "1" if dry_run else "3",
            "--device",
            device,
            "--out",
            "{out}",
        ),
        budget_s=20 if dry_run else 50,
        what="K-FAC steps vs SGD, AdamW and Muon steps",
    )
    ranks = ("--nodes", "2") if dry_run else ("--nodes", "4")
    dp = Part(
        name="dp",
        argv=(
            "plait.cli",
            "bench",
            "--workload",
            "mlp" if dry_run else "resnet18",
            "--strategies",
            "ssgd,acpsgd:rank=4" if dry_run else "ssgd,fp16,powersgd:rank=4,acpsgd:rank=4",
            *ranks,
            "--bandwidth",
            "slow" if dry_run else "slow,fast",
            "--steps",
            "1" if dry_run else "5",
            "--warmup",
            "0" if dry_run else "1",
            *(("--batch-size", "8", "--link", "model") if dry_run else ()),
            "--device",
            device,
            "--timeout",
            "40" if dry_run else "130",
            "--out",
            "{out}",
        ),
        budget_s=45 if dry_run else 140,
        what="data-parallel strategies, ranks sharing the GPU, slow and fast",
    )
    crossover = Part(
        name="crossover",
        argv=(
            "plait.cli",
            "crossover",
            "run",
            "mlp/ssgd" if dry_run else "resnet18/ssgd",
            "mlp/ssgd" if dry_run else "resnet18/ssgd",
            # the rehearsal co-locates the jobs under the token once; comparing them with
            # their runs alone needs jobs longer than the launches' jitter, minutes here
            *(("--mode", "crossover") if dry_run else ("--compare",)),
            "--nodes",
            "1" if dry_run else "2",
            "--bandwidth",
            "balanced",
            "--steps",
            "4" if dry_run else "12",
            "--warmup",
            "1" if dry_run else "3",
            *(("--link", "model") if dry_run else ()),
            "--device",
            device,
            "--timeout",
            "50" if dry_run else "100",
            "--out",
            "{out}",
        ),
        budget_s=55 if dry_run else 110,
        what="two co-located jobs, alone, uncoordinated and with crossover",
    )
    return [*fused, kfac, dp, crossover]


@dataclass(kw_only=True)
class PartResult:
    """What one part did."""

    name: str
    what: str
    command: str
    returncode: int | None
    wall_s: float
    timed_out: bool = False
    skipped: str | None = None
    files: list[str] = field(default_factory=list)
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.skipped is None and not self.timed_out and self.returncode == 0


def environment() -> dict[str, Any]:
    """The machine the suite ran on: host, torch, the GPU, whether tc can shape links."""
    import torch

    from plait.cluster.netns import tc_unavailable
    from plait.records import git_commit

    env: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": git_commit(),
        "gpus": [],
        "tc": tc_unavailable() or "available",
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            env["gpus"].append({"name": prop.name, "memory_bytes": prop.total_memory})
    return env


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_part(part: Part, out: Path, *, deadline: float) -> PartResult:
    """Run one part in its own process, its output in ``logs/NAME.log``, within its budget
    and the suite's deadline; a part that overruns is killed and recorded as timed out."""
    folder = out / part.name
    argv = [sys.executable, "-m", *(a.replace("{out}", str(folder)) for a in part.argv)]
    command = " ".join(argv[1:])
    left = deadline - time.monotonic()
    if left < 5:
        return PartResult(
            name=part.name,
            what=part.what,
            command=command,
            returncode=None,
            wall_s=0.0,
            skipped="the suite's time ran out before this part",
        )
    log = out / "logs" / f"{part.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    limit = min(part.budget_s, left)
    t0 = time.monotonic()
    timed_out = False
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            rc = proc.returncode
    files = sorted(str(p.relative_to(out)) for p in folder.rglob("*") if p.is_file())
    return PartResult(
        name=part.name,
        what=part.what,
        command=command,
        returncode=rc,
        wall_s=time.monotonic() - t0,
        timed_out=timed_out,
        files=files,
        log_tail=_tail(log),
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT first (plait tears its clusters down on it), then SIGKILL of the group."""
    import signal

    for sig, grace in ((signal.SIGINT, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def summary(env: dict[str, Any], results: Sequence[PartResult], *, dry_run: bool) -> str:
    """The suite's ``README.md``: the machine, then each part's outcome and where it wrote."""
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "none"
    lines = [
        f"# plait GPU suite{' (dry run, CPU)' if dry_run else ''}",
        "",
        f"GPU: {gpus}; torch {env['torch']} (CUDA {env['cuda']}); {env['cpus']} CPUs; "
        f"commit {env['commit']}; links: tc {env['tc']}.",
        "",
        "| part | what | result | seconds | folder |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        state = (
            "ok" if r.ok else r.skipped or ("timed out" if r.timed_out else f"exit {r.returncode}")
        )
        lines.append(f"| {r.name} | {r.what} | {state} | {r.wall_s:.0f} | {r.name}/ |")
    lines += ["", "Each part's command and log tail: suite.json; full logs: logs/."]
    return "\n".join(lines) + "\n"


def run_suite(out: Path, *, dry_run: bool = False, budget_s: float = DEFAULT_BUDGET_S) -> bool:
    """Run every part into `out` within `budget_s`; write suite.json, README.md and
    ``out.tar.gz``. Returns whether every part succeeded."""
    import torch

    if not dry_run and not torch.cuda.is_available():
        raise ValueError("the GPU suite needs a CUDA device (use --dry-run to rehearse it)")
    start = time.monotonic()
    deadline = start + budget_s
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    results: list[PartResult] = []
    for part in parts(dry_run=dry_run):
        print(f"gpu-suite: {part.name}: {part.what} ...", flush=True)
        res = run_part(part, out, deadline=deadline)
        results.append(res)
        state = "ok" if res.ok else (res.skipped or f"FAILED ({res.returncode})")
        print(f"gpu-suite: {part.name}: {state} in {res.wall_s:.0f} s", flush=True)
        _write(out, env, results, dry_run=dry_run, start=start, budget_s=budget_s)
    with tarfile.open(out.parent / f"{out.name}.tar.gz", "w:gz") as tar:
        tar.add(out, arcname=out.name)
    return all(r.ok for r in results)


def _write(
    out: Path,
    env: dict[str, Any],
    results: Sequence[PartResult],
    *,
    dry_run: bool,
    start: float,
    budget_s: float,
) -> None:
    doc = {
        "dry_run": dry_run,
        "budget_s": budget_s,
        "wall_s": time.monotonic() - start,
        "environment": env,
        "parts": [{**asdict(r), "ok": r.ok} for r in results],
    }
    (out / "suite.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "README.md").write_text(summary(env, results, dry_run=dry_run))


@dataclass(frozen=True, kw_only=True)
class SuiteConfig:
    """The command line of ``plait bench gpu-suite`` (its flags, `plait.flags`).

    Attributes:
        out: the suite's folder (its ``.tar.gz`` is written beside it).
        dry_run: the same parts, small, on the CPU: the suite's rehearsal.
        budget_s: seconds the whole suite may take.
    """

    out: Path = option(Path("runs/gpu-suite"))
    dry_run: bool = option(False, "the same parts, small, on the CPU (< 1 minute)")
    budget_s: float = option(DEFAULT_BUDGET_S)


def run_parsed(cfg: SuiteConfig, call: suites.Call) -> int:
    """Run every part; 0 when all succeeded, 1 when one failed, 2 on a bad budget or
    without CUDA (outside a dry run)."""
    if cfg.budget_s <= 0:
        print("gpu-suite: --budget-s must be > 0", file=sys.stderr)
        return 2
    try:
        ok = run_suite(cfg.out, dry_run=cfg.dry_run, budget_s=cfg.budget_s)
    except ValueError as exc:
        print(f"gpu-suite: {exc}", file=sys.stderr)
        return 2
    print((cfg.out / "README.md").read_text())
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.gpu_suite``: the suite ``gpu-suite`` (`plait.bench.suites`)."""
    return suites.main("gpu-suite", argv)


if __name__ == "__main__":
    raise SystemExit(main())
