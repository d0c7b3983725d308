"""Per-model hyper-parameter normalisation: one value for all models, or one per model."""

from __future__ import annotations

import pytest
import torch

from plait.fused.hparams import (
    coefficient,
    compact,
    per_model,
    per_model_ints,
    per_model_pairs,
)


def test_a_number_is_shared_and_a_sequence_or_tensor_is_per_model() -> None:
    assert per_model(0.1, num_models=3, name="lr") == [0.1, 0.1, 0.1]
    assert per_model([1, 2, 3], num_models=3, name="lr") == [1.0, 2.0, 3.0]
    assert per_model(torch.tensor([0.5, 0.25]), num_models=2, name="lr") == [0.5, 0.25]
    assert per_model(torch.tensor(2.0), num_models=2, name="lr") == [2.0, 2.0]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([0.1, 0.2], "lr has 2 values but the array holds 3 models"),
        (True, "lr must be a number"),  # bool is an int to Python, never a rate
        ("0.1", "lr must be a number"),
        ([0.1, None, 0.3], "lr must hold numbers"),
    ],
)
def test_bad_values_name_the_hyper_parameter(value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        per_model(value, num_models=3, name="lr")


def test_integer_settings_refuse_fractions() -> None:
    assert per_model_ints([2, 3.0], num_models=2, name="step_size") == [2, 3]
    with pytest.raises(ValueError, match="step_size must hold integers"):
        per_model_ints(1.5, num_models=2, name="step_size")


def test_pairs_are_shared_or_per_model() -> None:
    assert per_model_pairs((0.9, 0.99), num_models=2, name="betas") == [(0.9, 0.99)] * 2
    pairs = [(0.9, 0.99), (0.8, 0.9), (0.5, 0.5)]
    assert per_model_pairs(pairs, num_models=3, name="betas") == pairs
    with pytest.raises(ValueError, match="betas has 3 pairs but the array holds 2"):
        per_model_pairs(pairs, num_models=2, name="betas")
    with pytest.raises(ValueError, match="betas must hold pairs"):
        per_model_pairs([(0.9, 0.99), 0.5, (0.1, 0.2)], num_models=3, name="betas")


def test_compact_reads_like_torch_optim_when_values_agree() -> None:
    assert compact([0.1, 0.1]) == 0.1
    assert compact([0.1, 0.2]) == [0.1, 0.2]


def test_coefficient_rounds_once_like_python_float_arithmetic() -> None:
    like = torch.zeros(2, dtype=torch.float32)
    c = coefficient([0.1, 1 / 3], like, ndim=3)
    assert c.shape == (2, 1, 1) and c.dtype == torch.float32
    # a float64 value rounded once to float32, as `p.add_(g, alpha=lr)` rounds a Python lr
    assert c.flatten().tolist() == torch.tensor([0.1, 1 / 3], dtype=torch.float32).tolist()
