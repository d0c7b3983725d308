"""Enumeration: every candidate is a valid plan; excluded degrees are explained."""

from __future__ import annotations

from plait.models import GPT, GPTConfig
from plait.parallel import Plan, ZeroStage, adapter_for
from plait.parallel.planner import candidate_plans, excluded_degrees
from tests.parallel.common import gpt

GLOBAL_BATCH = 8


def test_candidates_are_valid_plans() -> None:
    model = gpt()
    dims = adapter_for(model).dims(model)
    plans = list(candidate_plans(4, dims, global_batch=GLOBAL_BATCH))
    assert len(plans) > 50
    for plan in plans:
        plan.validate(world=4, dims=dims)  # raises if the planner proposed an invalid plan
    assert {(p.dp, p.tp, p.pp) for p in plans} == {
        (4, 1, 1),
        (2, 2, 1),
        (2, 1, 2),
        (1, 4, 1),
        (1, 2, 2),
        (1, 1, 4),
    }


def test_candidates_respect_batch_and_axes() -> None:
    model = gpt()
    dims = adapter_for(model).dims(model)
    plans = list(candidate_plans(4, dims, global_batch=2))
    # dp=4 would split a batch of 2 unequally
    assert all(p.dp in (1, 2) for p in plans)
    # ZeRO-1 needs plain tensors (no tensor parallelism) and a data axis
    assert all(p.zero is not ZeroStage.OPTIMIZER or (p.tp == 1 and (p.dp or 1) > 1) for p in plans)
    assert Plan(dp=2, tp=2, zero=ZeroStage.PARAMETERS, sp=True) in plans


def test_excluded_tensor_degrees_name_the_dimension() -> None:
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=3, n_embd=24))
    dims = adapter_for(model).dims(model)
    assert {p.tp for p in candidate_plans(4, dims, global_batch=8)} == {1}
    why = excluded_degrees(4, dims)
    assert len(why) == 2 and all("heads=3" in w for w in why)


def test_no_pipeline_for_tied_parameters_nor_sequence_parallelism_the_model_refuses() -> None:
    """GPT-2 ties its embeddings to its head, BERT's classifier has no pipeline split and
    BERT norms inside its sub-layers: the planner proposed pp>1 and sp plans for them
    that failed when built."""
    import dataclasses

    from plait.parallel.adapters import ModelDims
    from plait.parallel.planner.enumerate import candidate_plans

    dims = ModelDims(layers=4, hidden=8, heads=2, ffn=32, params=1000, block_params=200, seq_len=8)
    plans = list(candidate_plans(4, dims, global_batch=16))
    assert any(p.pp > 1 for p in plans) and any(p.sp for p in plans)
    tied = dataclasses.replace(dims, no_pipeline="wte is tied to lm_head", no_sequence="norms")
    plans = list(candidate_plans(4, tied, global_batch=16))
    assert plans and not any(p.pp > 1 or p.sp for p in plans)
