"""`plait.models.small`: the digits CNN and the Transformer classifier."""

from __future__ import annotations

import torch

from plait.models.small import DigitsCNN, TransformerClassifier


def test_digits_cnn_shapes() -> None:
    model = DigitsCNN(width=4, num_classes=10).eval()
    assert model(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    assert model.fc.in_features == 8  # the second stage doubles the width


def test_transformer_classifier_shapes() -> None:
    torch.manual_seed(0)
    model = TransformerClassifier(vocab_size=20, seq_len=6, d_model=8, nhead=2, num_classes=3)
    idx = torch.randint(0, 20, (4, 6))
    assert model(idx).shape == (4, 3)
    assert model(idx[:, :3]).shape == (4, 3)  # shorter sequences than seq_len work
    # mean pooling: the order of the batch does not matter, each sample stands alone
    torch.testing.assert_close(model(idx.flip(0)), model(idx).flip(0))
