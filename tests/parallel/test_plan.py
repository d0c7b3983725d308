"""`Plan`: text form, field checks and validation against a world and a model."""

from __future__ import annotations

import pytest
import torch

from plait.parallel import Plan, Schedule, ZeroStage, adapter_for
from tests.parallel.common import gpt


def test_text_round_trip_and_defaults() -> None:
    plan = Plan.parse("dp=2,tp=2,zero=3,sp=true,ac=true")
    assert Plan.parse(plan.describe()) == plan
    assert plan.zero is ZeroStage.PARAMETERS
    assert Plan().describe() == "dp=auto"
    assert Plan(pp=2).n_microbatches() == 4 and Plan(pp=2).n_stages() == 2
    assert Plan(pp=2, schedule=Schedule.INTERLEAVED).n_stages() == 4


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tp=2,rnak=4", "unknown key 'rnak'"),
        ("sp=true", "needs tp > 1"),
        ("tp=2,zero=1", "needs tp=1"),
        ("offload=true", "needs zero=2 or zero=3"),
        ("zero=7", "invalid zero"),
        ("schedule=fast", "invalid schedule"),
        ("tp=0", "must be >= 1"),
        ("tp=2,compression=powersgd", "DDP comm hook"),
        ("pp=2,schedule=zero-bubble,zero=3", "does not compose"),
        ("pp=2,schedule=zero-bubble,ac=true", "holds more memory than without it"),
        ("microbatches=4", "applies to pipelines"),
        ("tp=two", "must be an integer"),
    ],
)
def test_bad_text_names_the_problem(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Plan.parse(text)


def test_validate_against_world_and_model() -> None:
    model = gpt()  # 4 blocks, 4 heads, width 32
    dims = adapter_for(model).dims(model)
    assert Plan(tp=2).validate(world=4, dims=dims) == Plan(dp=2, tp=2)
    with pytest.raises(ValueError, match="is not the world size 4"):
        Plan(dp=3).validate(world=4)
    with pytest.raises(ValueError, match="does not divide heads=4"):
        Plan(tp=8).validate(world=8, dims=dims)
    with pytest.raises(ValueError, match="need at least as many blocks"):
        Plan(pp=4, schedule=Schedule.INTERLEAVED).validate(world=4, dims=dims)
    with pytest.raises(ValueError, match="cannot fill"):
        Plan(pp=4, microbatches=2).validate(world=4, dims=dims)


def test_a_pipeline_of_a_model_without_blocks_names_the_model() -> None:
    """It used to say "the model has 0" layers, without naming the model or the remedy."""
    from torch import nn

    from plait.parallel import adapter_for

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))

    model = Flat()
    dims = adapter_for(model).dims(model)
    with pytest.raises(ValueError, match=r"the model Flat has 0 .*register a ModelAdapter"):
        Plan.parse("pp=2").validate(world=2, dims=dims)
