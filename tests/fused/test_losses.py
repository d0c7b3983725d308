"""Per-model losses and metrics: entry b is exactly model b's stock loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.fused import accuracy, cross_entropy, mse_loss, per_model_loss


def test_cross_entropy_is_each_models_mean_loss() -> None:
    logits, target = torch.randn(3, 5, 4), torch.randint(0, 4, (3, 5))
    losses = cross_entropy(logits, target)
    assert losses.shape == (3,)
    for b in range(3):
        torch.testing.assert_close(losses[b], F.cross_entropy(logits[b], target[b]))


def test_targets_without_the_model_dimension_are_shared() -> None:
    logits, target = torch.randn(2, 6, 3, 5), torch.randint(0, 5, (6, 3))  # sequence logits
    losses = cross_entropy(logits, target)
    for b in range(2):
        ref = F.cross_entropy(logits[b].reshape(-1, 5), target.reshape(-1))
        torch.testing.assert_close(losses[b], ref)
    out, y = torch.randn(2, 4, 3), torch.randn(4, 3)
    torch.testing.assert_close(mse_loss(out, y), torch.stack([F.mse_loss(o, y) for o in out]))


def test_any_elementwise_loss_and_accuracy_per_model() -> None:
    out, y = torch.randn(3, 4, 2), torch.randn(3, 4, 2)
    ref = torch.stack([F.l1_loss(out[b], y[b]) for b in range(3)])
    torch.testing.assert_close(per_model_loss(F.l1_loss, out, y), ref)
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [0.0, 1.0]]])
    assert accuracy(logits, torch.tensor([0, 0])).tolist() == [0.5, 0.0]
