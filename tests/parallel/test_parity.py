"""Every plan reproduces single-process training of the same model.

For each world size one group of processes trains every plan in turn (spawning is the
expensive part), 20 steps each, and the losses are compared with the stock model trained
on one process over the whole batch. The same processes check that a distributed
checkpoint saved under one plan continues exactly under another, and that bad plans fail
before any process group is created.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket

from plait.dp.compress.allreduce import AllReduce
from plait.models import GPT, GPTConfig
from plait.parallel import ParallelModel, Plan, parallelize
from plait.parallel import checkpoint as pcheckpoint
from plait.testing import run_distributed
from tests.parallel.common import (
    BATCH,
    MODELS,
    SEQ,
    STEPS,
    VOCAB,
    batches,
    loss_fn,
    reference_losses,
)

# (model, plan) per world size: every axis, ZeRO stage, schedule and option appears at
# least once, alone and combined
PLANS: dict[int, list[tuple[str, str]]] = {
    1: [
        ("gpt", "dp=1"),
        ("gpt", "dp=1,ac=true"),
        ("gpt", "zero=3,offload=true"),
    ],
    2: [
        ("gpt", "dp=2"),
        ("gpt", "dp=2,zero=1,compression=test-counted"),
        ("gpt", "dp=2,zero=2"),
        ("gpt", "dp=2,zero=3,offload=true"),
        ("gpt", "tp=2"),
        ("gpt", "tp=2,sp=true,ac=true"),
        ("gpt", "pp=2,schedule=gpipe"),
        ("gpt", "pp=2,schedule=1f1b"),
        ("gpt", "pp=2,schedule=interleaved,microbatches=8"),
        ("gpt", "pp=2,schedule=zero-bubble"),
        ("encoder", "tp=2,sp=true"),
        ("encoder", "pp=2"),
        ("encoder", "dp=2,zero=3"),
    ],
    4: [
        ("gpt", "dp=4,zero=3"),
        ("gpt", "dp=2,tp=2,zero=2,ac=true"),
        ("gpt", "dp=2,pp=2,zero=1,schedule=interleaved"),
        ("gpt", "dp=2,pp=2,zero=3"),
        ("gpt", "tp=2,pp=2,sp=true"),
        ("gpt", "tp=2,pp=2,schedule=zero-bubble"),
        ("gpt8", "pp=4,schedule=interleaved"),
    ],
}


class CountedAllReduce(AllReduce):
    """S-SGD's hook, counting its calls: shows a plan's data axis runs plait's compressors."""

    name = "test-counted"
    calls = 0

    def hook(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        CountedAllReduce.calls += 1
        return super().hook(bucket)


# save after half the steps under the first plan, continue under the second
RELOADS: dict[int, list[tuple[str, str]]] = {
    1: [],
    2: [("pp=2,schedule=interleaved", "tp=2")],
    4: [
        ("dp=4,zero=3", "dp=2,pp=2,zero=1,schedule=interleaved"),
        ("dp=2,pp=2,zero=3", "dp=2,tp=2,zero=2"),
    ],
}


def _steps(
    pmodel: ParallelModel, opt: torch.optim.Optimizer, xs: torch.Tensor, ys: torch.Tensor
) -> list[float]:
    shard = BATCH // pmodel.data_parallel_size
    lo = pmodel.data_parallel_rank * shard
    losses = []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        losses.append(float(pmodel.step(x[lo : lo + shard], y[lo : lo + shard])))
        opt.step()
    return losses


def _parallel(
    model_name: str, spec: str, *, zero_weights: bool = False
) -> tuple[ParallelModel, torch.optim.Optimizer]:
    model = MODELS[model_name]()
    if zero_weights:  # everything must then come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), spec, loss_fn=loss_fn)


def _worker(rank: int, world: int, path: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    xs, ys = batches()
    out: dict[str, Any] = {}
    for model_name, spec in PLANS[world]:
        out[f"{model_name}/{spec}"] = _steps(*_parallel(model_name, spec), xs, ys)
    out["compressor calls"] = CountedAllReduce.calls
    half = STEPS // 2
    for i, (first, second) in enumerate(RELOADS[world]):
        pmodel, opt = _parallel("gpt", first)
        losses = _steps(pmodel, opt, xs[:half], ys[:half])
        pcheckpoint.save(f"{path}/{i}", pmodel, opt)
        pmodel, opt = _parallel("gpt", second, zero_weights=True)
        pcheckpoint.load(f"{path}/{i}", pmodel, opt)
        out[f"reload {first} -> {second}"] = losses + _steps(pmodel, opt, xs[half:], ys[half:])
    # bad input fails with a clear error before any process group is created
    groups = len(dist.distributed_c10d._pg_map)
    bad_plans = [(f"dp={world + 1}", "not the world size")]
    if world > 1:  # 3 heads: no tensor degree of 2 or 4 divides them
        bad_plans.append((f"tp={world}", "does not divide heads=3"))
    errors = []
    for bad, match in bad_plans:
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=3, n_embd=48))
        with pytest.raises(ValueError, match=match) as info:
            parallelize(model, torch.optim.SGD(model.parameters()), bad)
        errors.append(str(info.value))
    out["errors"] = errors
    out["groups_unchanged"] = len(dist.distributed_c10d._pg_map) == groups
    return out


_CACHE: dict[int, list[dict[str, Any]]] = {}
_REFERENCE: dict[str, list[float]] = {}


def _results(world: int) -> list[dict[str, Any]]:
    if world not in _CACHE:
        with tempfile.TemporaryDirectory() as path:
            _CACHE[world] = run_distributed(_worker, path, world_size=world, timeout_s=400)
    return _CACHE[world]


def _reference(model: str) -> list[float]:
    if model not in _REFERENCE:
        _REFERENCE[model] = reference_losses(model)
    return _REFERENCE[model]


def _assert_matches(losses: list[float], ref: list[float]) -> None:
    assert len(losses) == STEPS
    # fp32: sharded matmuls, reduce-scatters and micro-batch means sum in another order and
    # differ in the last bits; through 20 AdamW steps the losses stay within 1e-5
    torch.testing.assert_close(losses, ref, rtol=0, atol=1e-5)


# ZeRO-3 at world 4 is the longest case; world 2 and tests/parallel/test_derive.py's world-4
# combination hold the same mechanism: `make test-all` only
_SLOW = {(4, "gpt", "dp=4,zero=3")}


@pytest.mark.parametrize(
    ("world", "model", "spec"),
    [
        pytest.param(w, m, s, marks=[pytest.mark.slow] if (w, m, s) in _SLOW else [])
        for w, plans in PLANS.items()
        for m, s in plans
    ],
)
def test_plan_matches_single_process(world: int, model: str, spec: str) -> None:
    for rank_result in _results(world):
        _assert_matches(rank_result[f"{model}/{spec}"], _reference(model))


@pytest.mark.parametrize(
    ("world", "first", "second"), [(w, a, b) for w, pairs in RELOADS.items() for a, b in pairs]
)
def test_checkpoint_reloads_under_another_plan(world: int, first: str, second: str) -> None:
    for rank_result in _results(world):
        _assert_matches(rank_result[f"reload {first} -> {second}"], _reference("gpt"))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bad_plans_fail_before_any_group(world: int) -> None:
    for rank_result in _results(world):
        assert rank_result["groups_unchanged"]
        assert len(rank_result["errors"]) == (1 if world == 1 else 2)


def test_compression_runs_on_the_data_axis() -> None:
    assert all(r["compressor calls"] >= STEPS for r in _results(2))


def test_plan_text_round_trip() -> None:
    plan = Plan.parse("dp=2,tp=2,zero=3,sp=true,ac=true")
    assert Plan.parse(plan.describe()) == plan
