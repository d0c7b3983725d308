"""Planning a user's workload from one process: a transformers model, explained."""

from __future__ import annotations

import pytest

from plait.comm import AlphaBeta
from plait.parallel.planner import plan_workload

pytest.importorskip("transformers")


def test_plan_workload_accepts_a_factory_and_explains_itself() -> None:
    choice = plan_workload(
        "tests.parallel.hf_models:llama_workload",
        world=2,
        network=AlphaBeta.from_rate(1e8),
        slots=2,
    )
    assert {e.plan.tp for e in choice.estimates} == {1, 2}  # the derived plan is priced
    assert "LlamaForCausalLM" in choice.reason
    assert "base_model_tp_plan" in choice.reason
    assert choice.reason.startswith(f"chose {choice.plan.describe()}")
