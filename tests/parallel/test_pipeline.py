"""Pipeline stages: splitting units, stage placement per schedule, original state keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.parallel import Schedule, adapter_for
from plait.parallel.pipeline import StageModule, split_units, stage_indices
from tests.parallel.common import batches, gpt


def test_blocks_spread_evenly_and_others_join_their_neighbours() -> None:
    units = [("emb", nn.Identity())] + [(f"b.{i}", nn.Identity()) for i in range(4)]
    units.append(("head", nn.Identity()))
    stages = split_units(units, [f"b.{i}" for i in range(4)], 2)
    assert [[n for n, _ in s] for s in stages] == [["emb", "b.0", "b.1"], ["b.2", "b.3", "head"]]
    with pytest.raises(ValueError, match="need at least 8 blocks"):
        split_units(units, [f"b.{i}" for i in range(4)], 8)


def test_stage_indices_per_schedule() -> None:
    assert stage_indices(Schedule.ONE_F_ONE_B, 2, 1) == [1]
    assert stage_indices(Schedule.INTERLEAVED, 2, 1) == [1, 3]
    assert stage_indices(Schedule.ZERO_BUBBLE, 2, 0) == [0, 3]
    assert stage_indices(Schedule.GPIPE, 1, 0) == [0]


def test_stages_chain_to_the_model_and_keep_its_keys() -> None:
    model = gpt()
    adapter = adapter_for(model)
    units = adapter.pipeline_units(model)
    stages = [StageModule(s) for s in split_units(units, adapter.blocks(model), 2)]
    keys = set().union(*(s.state_dict().keys() for s in stages))
    assert keys == set(model.state_dict().keys())
    x = batches(1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)
