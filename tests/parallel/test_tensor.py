"""Activation checkpointing keeps gradients and names (tensor parallelism runs in the
multi-process parity tests)."""

from __future__ import annotations

import torch

from plait.parallel.tensor import checkpoint_activations
from tests.parallel.common import batches, gpt, loss_fn


def test_checkpointing_recomputes_the_same_gradients() -> None:
    xs, ys = batches(1)
    plain, ckpt = gpt(), gpt()
    assert isinstance(ckpt.blocks, torch.nn.ModuleList)
    checkpoint_activations(list(ckpt.blocks))
    loss_fn(plain(xs[0]), ys[0]).backward()
    loss_fn(ckpt(xs[0]), ys[0]).backward()
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]
    for p, q in zip(plain.parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)
