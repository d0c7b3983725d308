"""`plait.data.synthetic`: seeded random classification and token data."""

from __future__ import annotations

import torch

from plait.data.synthetic import synthetic_classification, synthetic_tokens


def test_classification_shapes_labels_and_seed() -> None:
    data = synthetic_classification(n=50, input_shape=(3, 4), num_classes=5, seed=1)
    x, y = data.tensors
    assert x.shape == (50, 3, 4) and y.shape == (50,)
    assert int(y.min()) >= 0 and int(y.max()) < 5
    again = synthetic_classification(n=50, input_shape=(3, 4), num_classes=5, seed=1)
    assert torch.equal(again.tensors[0], x)


def test_token_targets_are_the_inputs_shifted() -> None:
    x, y = synthetic_tokens(n=4, block_size=6, vocab_size=9).tensors
    assert x.shape == y.shape == (4, 6)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 9
