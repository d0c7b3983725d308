from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from plait.comm import all_reduce
from plait.testing import run_distributed
from plait.trace import COMPUTE, Tracer, span, tracer


def _traced(rank: int, world: int, path: str) -> bool:
    tracer.enable()
    with span("forward", COMPUTE):
        time.sleep(0.01)
    all_reduce(torch.ones(1000)).wait()
    return tracer.save(path) is not None


def test_merged_trace_has_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    wrote = run_distributed(_traced, str(path), world_size=2)
    assert wrote == [True, False]  # rank 0 writes the merged file
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for pid in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == pid}
        assert {"forward", "all_reduce"} <= names
        fwd = next(e for e in spans if e["pid"] == pid and e["name"] == "forward")
        assert fwd["dur"] >= 9_000  # microseconds
    comm = [e for e in spans if e["cat"] == "comm"]
    assert all(e["tid"] == "comm" and e["args"]["bytes"] == 4000 for e in comm)


def test_disabled_tracer_records_nothing() -> None:
    t = Tracer()
    with t.span("x"):
        pass
    assert t.events(0) == [t.events(0)[0]]  # only the process-name metadata


def _profiled_names(rank: int, world: int, specs: list[str]) -> list[set[str]]:
    """The event names a torch.profiler trace of one training step of each spec holds."""
    from torch.profiler import ProfilerActivity, profile

    from plait.train.loop import TrainConfig, Trainer

    names = []
    for spec in specs:
        cfg = TrainConfig(
            workload="mlp", strategy=spec, steps=1, batch_size=8, progress=False, seed=rank
        )
        trainer = Trainer(cfg)
        try:
            batch = next(trainer.batches(0, 0))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.train_step([batch])
            names.append({e.name for e in prof.events()})
        finally:
            trainer.close()
    return names


def test_spans_reach_the_torch_profiler() -> None:
    """Compression, factor communication and inversion are named in a profiler trace, with
    plait's own tracer off (a user profiling a plait run need not enable it)."""
    assert not tracer.enabled
    specs = ["acpsgd:rank=2,warmup=0", "spd-kfac:inv_interval=1"]
    acp, kfac = run_distributed(_profiled_names, specs, world_size=2)[0]
    assert {"forward", "backward", "optimizer"} <= acp
    assert any(n.startswith("compress b") for n in acp), sorted(acp)
    assert any(n.startswith("factors b") for n in kfac), sorted(kfac)
    assert any(n.startswith("inverse ") for n in kfac), sorted(kfac)


def test_profiled_is_free_without_a_profiler() -> None:
    from plait.trace import profiled, profiler_active

    assert not profiler_active()
    with profiled("x") as ctx:
        assert ctx is None  # a nullcontext: no record function opened
