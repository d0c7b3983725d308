"""Which collectives gloo runs on CUDA tensors, and the refusal before launch."""

from __future__ import annotations

import pytest

from plait.comm import Collective, check_collectives, unsupported
from plait.train.strategy import make_strategy


def test_gloo_on_cuda_lacks_point_to_point_only() -> None:
    every = set(Collective)
    assert unsupported(every, backend="gloo", device="cuda:0") == [Collective.SEND]
    assert unsupported(every, backend="gloo", device="cpu") == []
    assert unsupported(every, backend="cpu:gloo,cuda:nccl", device="cuda:1") == []


@pytest.mark.parametrize(
    "spec", ["ssgd", "acpsgd:rank=2", "powersgd:rank=2", "topk", "spd-kfac", "plan:tp=2"]
)
def test_data_parallel_kfac_and_tensor_plans_run_on_ranks_sharing_a_gpu(spec: str) -> None:
    strategy = make_strategy(spec)
    assert Collective.ALL_REDUCE in strategy.collectives()
    check_collectives(spec, strategy.collectives(), backend="gloo", device="cuda:0")


@pytest.mark.parametrize("spec", ["plan:pp=2", "plan:auto=true"])
def test_pipeline_plans_are_refused_on_ranks_sharing_a_gpu(spec: str) -> None:
    strategy = make_strategy(spec)
    with pytest.raises(ValueError, match="send and receive take host memory only"):
        check_collectives(spec, strategy.collectives(), backend="gloo", device="cuda:0")
    check_collectives(spec, strategy.collectives(), backend="gloo", device="cpu")
