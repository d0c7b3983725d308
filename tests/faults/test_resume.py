"""A worker killed mid-run loses nothing: every strategy family resumes from its newest
complete checkpoint and ends where an uninterrupted run of the same seed ends.

Each test runs two jobs of two gloo processes. The first trains the uninterrupted
reference (rank 0 writes its final parameters), then starts the same run with checkpoints
and kills rank 1 with ``os._exit`` partway (the job dies). The second job starts fresh
processes on the checkpoint directory, as torchrun's restart would, resumes and finishes;
its final parameters must equal the reference's bit for bit: resuming restores the
parameters, the optimizer, the data position, the random generators and each rank's own
strategy state (compressor error feedback, K-FAC factors), so every later step computes
exactly what the uninterrupted run computed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.testing import WorkerError, run_distributed

STEPS, EVERY = 12, 4


def _config(spec: str, plan: str | None, ckpt: Path | None) -> Any:
    from plait.train.loop import TrainConfig

    return TrainConfig(
        workload="mlp",
        strategy=spec,
        plan=plan,
        data="synthetic",
        synthetic_samples=512,
        steps=STEPS,
        batch_size=8,
        seed=3,
        checkpoint=None if ckpt is None else str(ckpt),
        checkpoint_every=EVERY,
        progress=False,
    )


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    if trainer.strategy.checkpoint_state(trainer.model, trainer.optimizer) is not None:
        # sharded plans: gather the full parameters (a collective on every rank)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        module = trainer.strategy.unwrap(trainer.model)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
        sd = get_model_state_dict(module, options=opts)
    else:
        sd = trainer.strategy.unwrap(trainer.model).state_dict()
    return {k: v.detach().clone().cpu() for k, v in sd.items()}


def _train(spec: str, plan: str | None, ckpt: Path | None, die_at: int | None = None) -> Any:
    from plait.train.loop import Trainer

    trainer = Trainer(_config(spec, plan, ckpt))
    if die_at is not None:
        step = trainer.train_step

        def dying_step(micro: Any) -> float:
            if trainer.state.step == die_at and trainer.rank == 1:
                os._exit(17)  # a killed worker: no exception, no cleanup, no flush
            return step(micro)

        trainer.train_step = dying_step  # type: ignore[method-assign]
    try:
        trainer.run()
        return trainer
    finally:
        trainer.close()


def _reference_then_killed(
    rank: int, world: int, spec: str, plan: str | None, tmp: str, die_at: int
) -> None:
    ref = _train(spec, plan, None)
    params = _params(ref)
    if rank == 0:
        torch.save(params, Path(tmp) / "reference.pt")
    _train(spec, plan, Path(tmp) / "ckpt", die_at=die_at)
    raise AssertionError("the worker was not killed")


def _resumed(rank: int, world: int, spec: str, plan: str | None, tmp: str) -> dict[str, Any]:
    trainer = _train(spec, plan, Path(tmp) / "ckpt")
    return {
        "params": _params(trainer),
        "resumed_from": trainer.resumed_from,
        "strategy": trainer.strategy.state_dict(),
    }


def _kill_and_resume(tmp_path: Path, spec: str, plan: str | None = None) -> dict[str, Any]:
    die_at = 2 * EVERY + 1  # after the checkpoint at step 8, before the next one
    with pytest.raises(WorkerError, match=r"died|raised"):
        run_distributed(
            _reference_then_killed,
            spec,
            plan,
            str(tmp_path),
            die_at,
            world_size=2,
            timeout_s=20,
        )
    assert (tmp_path / "ckpt" / f"step_{2 * EVERY:08d}" / "MANIFEST.json").is_file()
    # whatever the survivor did after its peer died, no later checkpoint counts as complete
    assert not (tmp_path / "ckpt" / f"step_{STEPS:08d}" / "MANIFEST.json").exists()
    out = run_distributed(_resumed, spec, plan, str(tmp_path), world_size=2, timeout_s=90)
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    for r in out:
        assert r["resumed_from"] == 2 * EVERY
        assert r["params"].keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=0, msg=name)
    return out[0]


def test_ssgd_resumes_exactly_after_a_killed_worker(tmp_path: Path) -> None:
    _kill_and_resume(tmp_path, "ssgd")


def test_compressor_resumes_with_its_error_feedback(tmp_path: Path) -> None:
    # ACP-SGD alternates P and Q steps and carries an error-feedback residual per rank:
    # losing either changes every step after the resume
    out = _kill_and_resume(tmp_path, "acpsgd:rank=2,warmup=2")
    assert out["strategy"]["compressor"]["steps"] == STEPS


def test_kfac_resumes_with_its_factors(tmp_path: Path) -> None:
    out = _kill_and_resume(tmp_path, "kfac-naive")
    assert out["strategy"]["kfac"]["second_order"], "K-FAC factors were not carried"


def test_parallel_plan_resumes_from_its_distributed_checkpoint(tmp_path: Path) -> None:
    _kill_and_resume(tmp_path, "ssgd", plan="dp=2,zero=3")
    assert any((tmp_path / "ckpt").glob("step_*/sharded/.metadata"))


def _dp_state_dict_round_trip(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import io

    from torch import nn

    from plait.dp import compressor_of, data_parallel

    def make() -> Any:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        ddp = data_parallel(net, "acpsgd", rank=2, warmup=1)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step(ddp: Any, opt: Any, i: int) -> None:
        g = torch.Generator().manual_seed(100 * i + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    ddp, opt = make()
    for i in range(3):
        step(ddp, opt, i)
    # the usual DDP checkpoint, one file per rank, loaded as weights only
    buf = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert "plait_compressor" in saved["model"]
    fresh, fresh_opt = make()
    fresh.load_state_dict(saved["model"])  # strict: the compressor key is not "unexpected"
    fresh_opt.load_state_dict(saved["optim"])
    comp_a, comp_b = compressor_of(ddp), compressor_of(fresh)
    assert comp_a is not None and comp_b is not None
    assert comp_b.state_dict()["steps"] == comp_a.state_dict()["steps"] == 3
    for i in range(3, 6):
        step(ddp, opt, i)
        step(fresh, fresh_opt, i)
    pairs = zip(ddp.parameters(), fresh.parameters(), strict=True)
    return {
        "same": all(torch.equal(a, b) for a, b in pairs),
        "error_norm": float(sum(s["error"].norm() for s in comp_b.state_dict()["params"].values())),
    }


def test_data_parallel_state_dict_carries_the_compressor(tmp_path: Path) -> None:
    # without the compressor's residuals and step counter in the model's state_dict, the
    # reloaded model would re-run warm-up and drop the residuals: its parameters diverge
    out = run_distributed(_dp_state_dict_round_trip, str(tmp_path), world_size=2, timeout_s=60)
    for r in out:
        assert r["same"]
        assert r["error_norm"] > 0
