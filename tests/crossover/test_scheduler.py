from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from plait.testing import run_distributed
from plait.train.loop import TrainConfig, Trainer


def _train(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    trainer = Trainer(cfg)
    try:
        trainer.run()
        return trainer.summary()
    finally:
        trainer.close()


def _cfg(workload: str, crossover: str | None, strategy: str = "ssgd") -> TrainConfig:
    return TrainConfig(
        workload=workload,
        strategy=strategy,
        data="synthetic",
        steps=6,
        batch_size=4,
        progress=False,
        crossover=crossover,
        synthetic_samples=64,
    )


# plain, compressed (state carried across steps) and K-FAC (work after backward) strategies
@pytest.mark.parametrize(
    ("a_job", "b_job"),
    [
        (("mlp", "ssgd"), ("gpt", "ssgd")),
        # stateful strategies on both sides: the longest pair, `make test-all` only
        pytest.param(("mlp", "acpsgd:rank=2"), ("mlp", "spd-kfac"), marks=pytest.mark.slow),
    ],
)
def test_colocated_jobs_train_exactly_as_alone(
    tmp_path: Path, a_job: tuple[str, str], b_job: tuple[str, str]
) -> None:
    env = {"PLAIT_TOKEN_DIR": str(tmp_path)}
    jobs = {"a": a_job, "b": b_job}
    alone = {
        name: run_distributed(_train, _cfg(w, None, s), world_size=2)[0]
        for name, (w, s) in jobs.items()
        if name == "a" or s != "ssgd"
    }
    results: dict[str, Any] = {}

    def job(name: str) -> None:
        workload, strategy = jobs[name]
        cfg = _cfg(workload, "grp", strategy)
        results[name] = run_distributed(_train, cfg, world_size=2, env=env)[0]

    threads = [threading.Thread(target=job, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    # the token changes when a job computes, never what it computes
    for name, ref in alone.items():
        assert results[name]["step_losses"] == ref["step_losses"], name
    for r in results.values():
        assert r["crossover"]["acquisitions"] == 6  # one forward/backward per step
    # the two jobs really shared the device token: someone waited for the other
    assert sum(r["crossover"]["wait_s"] for r in results.values()) > 0


def test_eval_forward_does_not_take_the_token(tmp_path: Path) -> None:
    import torch

    from plait.crossover import ComputeToken, Crossover

    model = torch.nn.Linear(3, 2)
    tok = ComputeToken("g", key="k", directory=tmp_path)
    xo = Crossover(model, group="g", token=tok)
    with torch.no_grad():
        model(torch.ones(1, 3))
    assert xo.stats.acquisitions == 0
    model(torch.ones(1, 3)).sum().backward()
    assert xo.stats.acquisitions == 1 and not tok.held  # released after backward
    xo.close()
    with pytest.raises(ValueError, match="no trainable parameters"):
        Crossover(torch.nn.ReLU(), group="g", token=ComputeToken("g", key="k", directory=tmp_path))


def _gated_loop(rank: int, world: int, steps: int, crash_at: int | None) -> int:
    import os

    import torch

    import plait
    from plait.crossover import attach

    torch.manual_seed(0)
    model = plait.data_parallel(torch.nn.Linear(32, 32))
    xo = attach(model, group="grp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        if crash_at is not None and step == crash_at:
            xo.token.acquire()  # die while holding the device's token
            os._exit(1)
        opt.zero_grad()
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
    xo.close()
    return steps


def test_jobs_of_different_lengths_and_a_crash_never_block_the_others(tmp_path: Path) -> None:
    from plait.testing import WorkerError

    env = {"PLAIT_TOKEN_DIR": str(tmp_path)}
    outcome: dict[str, Any] = {}

    def job(name: str, steps: int, crash_at: int | None) -> None:
        try:
            outcome[name] = run_distributed(
                _gated_loop, steps, crash_at, world_size=2, env=env, timeout_s=120
            )
        except WorkerError as exc:
            outcome[name] = exc

    threads = [
        threading.Thread(target=job, args=("short", 3, None)),
        threading.Thread(target=job, args=("long", 40, None)),
        threading.Thread(target=job, args=("crash", 40, 5)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert outcome["short"] == [3, 3]
    assert outcome["long"] == [40, 40]  # outlived the short job and the crashed one
    assert isinstance(outcome["crash"], WorkerError)


def test_gate_policy_in_one_process(tmp_path: Path) -> None:
    import torch

    from plait.crossover import ComputeToken, Crossover

    class Wrapper(torch.nn.Module):  # stands for DDP: the gate goes on `.module`
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.module(x)
            return out

    inner = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    inner[0].requires_grad_(False)  # frozen layers do not hold the release back
    model = Wrapper(inner)
    tok = ComputeToken("g", key="policy", directory=tmp_path)
    xo = Crossover(model, group="g", token=tok)
    inner.eval()
    model(torch.ones(1, 3))  # evaluation: no token
    assert xo.stats.acquisitions == 0
    inner.train()
    out = model(torch.ones(1, 3))
    assert tok.held  # taken before the forward computes
    model(torch.ones(1, 3))  # a second forward while holding it: no second acquisition
    out.sum().backward()
    assert not tok.held and xo.stats.acquisitions == 1
    xo.close()
    xo.close()  # idempotent
    model(torch.ones(1, 3)).sum().backward()  # hooks gone: no gate any more
    assert xo.stats.acquisitions == 1
