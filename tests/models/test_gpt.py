"""`plait.models.gpt`: shapes, parameter count, causality, config checks."""

from __future__ import annotations

import pytest
import torch

from plait.models.gpt import GPT, GPTConfig


def _params_by_formula(cfg: GPTConfig) -> int:
    d, v, t = cfg.n_embd, cfg.vocab_size, cfg.block_size
    block = 2 * (2 * d) + 4 * (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return v * d + t * d + cfg.n_layer * block + 2 * d + d * v  # head without bias


def test_logits_shape_and_parameter_count() -> None:
    cfg = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg)
    logits = model(torch.randint(0, 17, (3, 5)))
    assert logits.shape == (3, 5, 17)
    assert sum(p.numel() for p in model.parameters()) == _params_by_formula(cfg)


def test_is_causal_and_generates() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=8)).eval()
    idx = torch.randint(0, 11, (1, 6))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 11
    # a later token never changes an earlier position's logits
    torch.testing.assert_close(model(idx)[:, :-1], model(changed)[:, :-1])
    out = model.generate(idx[:, :2], max_new_tokens=7)
    assert out.shape == (1, 9)
    assert torch.equal(out[:, :2], idx[:, :2])


def test_bad_config_and_input() -> None:
    with pytest.raises(ValueError, match="must divide n_embd"):
        GPTConfig(n_head=3, n_embd=16)
    with pytest.raises(ValueError, match=">= 1"):
        GPTConfig(n_layer=0)
    model = GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4))
    with pytest.raises(ValueError, match="exceeds block_size 4"):
        model(torch.zeros(1, 5, dtype=torch.long))
