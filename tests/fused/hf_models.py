"""Tiny transformers models built from configs (nothing is downloaded), and their inputs.

GPT-2 (Conv1D, tied embeddings, GELU-tanh, causal attention), BERT (padding masks,
absolute positions, token types), Llama (RMSNorm, rotary embeddings, SiLU-gated MLP,
grouped-query attention) and ResNet (convolutions, batch norm, max pooling): the
architectures people sweep, at sizes that train in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from plait.fused import FusedAdam, FusedSGD
from tests.fused.helpers import build, rel_err

transformers = pytest.importorskip("transformers")

B = 2
VOCAB = 48


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model: nn.Module = transformers.GPT2LMHeadModel(cfg)
    return model


def bert() -> nn.Module:
    cfg = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=VOCAB,
        max_position_embeddings=8,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model: nn.Module = transformers.BertForSequenceClassification(cfg)
    return model


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        vocab_size=VOCAB,
        max_position_embeddings=8,
        bos_token_id=0,
        eos_token_id=0,
    )
    model: nn.Module = transformers.LlamaForCausalLM(cfg)
    return model


def resnet() -> nn.Module:
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3, layer_type="basic"
    )
    model: nn.Module = transformers.ResNetForImageClassification(cfg)
    return model


def tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (B, 4, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def padding_mask(g: torch.Generator, shape: tuple[int, ...] = (B, 4, 8)) -> torch.Tensor:
    """An attention mask with 1 to 3 padded positions at the end of some sequences, set
    per model and per sequence (1 = attend, 0 = padding)."""
    lengths = shape[-1] - torch.randint(0, 4, shape[:-1], generator=g)
    return (torch.arange(shape[-1]) < lengths.unsqueeze(-1)).long()


def padded_tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    """Language-model tokens with per-model padding (a causal and a padding mask)."""
    ids = torch.randint(0, VOCAB, (B, 4, 8), generator=g)
    mask = padding_mask(g)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def classified_tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, VOCAB, (B, 4, 8), generator=g),
        "labels": torch.randint(0, 3, (B, 4), generator=g),
    }


def padded_classified_tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {**classified_tokens(g), "attention_mask": padding_mask(g)}


def images(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.randn(B, 4, 3, 16, 16, generator=g),
        "labels": torch.randint(0, 3, (B, 4), generator=g),
    }


MODELS = {
    "gpt2": (gpt2, tokens),
    "bert": (bert, classified_tokens),
    "llama": (llama, tokens),
    "resnet": (resnet, images),
}

#: The same models with per-model padding masks where they take one: vmap cannot run
#: them (transformers checks the mask's values in Python), a captured array can.
PADDED = {**MODELS, "gpt2": (gpt2, padded_tokens), "bert": (bert, padded_classified_tokens)}

# BERT's attention key bias adds the same number to every score of a query, which the
# softmax removes: its exact gradient is zero and both runs step it by rounding noise
# alone, with no effect on any output. It is left out of the comparisons.
ZERO_GRADIENT = ("attention.self.key.bias",)


def train_like_stock(
    array: nn.Module,
    factory: Callable[[], nn.Module],
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]],
    optimizer: str,
    *,
    steps: int = 10,
) -> float:
    """Train `array` (B models built by `factory` with seeds 0..B-1) and B stock models
    `steps` steps on the same per-model batches, with per-model learning rates (plait's
    fused optimizer against torch.optim); the largest relative difference of any member's
    exported state from its stock model's."""
    stock = build(factory, B)
    if optimizer == "sgd":
        lrs = [0.05, 0.1]
        opt: torch.optim.Optimizer = FusedSGD(array.parameters(), lr=lrs, momentum=0.9)
        stock_opts: list[torch.optim.Optimizer] = [
            torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
            for m, lr in zip(stock, lrs, strict=True)
        ]
    else:
        # Adam turns each element's gradient, rounding noise included, into a step of
        # about lr, so fp32 runs that sum in different orders drift apart in proportion
        # to lr: at 1e-3 stock fp32 GPT-2 and Llama end 1e-4 from float64 themselves.
        # Rates in the usual transformer range keep that noise below the 1e-5 bound.
        lrs = [5e-5, 1e-4]
        opt = FusedAdam(array.parameters(), lr=lrs)
        stock_opts = [
            torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(stock, lrs, strict=True)
        ]
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        inputs = batch(g)
        out = array(**inputs)
        assert out.loss.shape == (B,)  # the model's own loss, one per model
        out.loss.sum().backward()
        opt.step()
        opt.zero_grad()
        for b, m in enumerate(stock):
            m(**{k: v[b] for k, v in inputs.items()}).loss.backward()
            stock_opts[b].step()
            stock_opts[b].zero_grad()
    err = 0.0
    for b, state in enumerate(array.to_models()):
        stock[b].load_state_dict(state)  # every key, tied ones included, is exported
        for k, v in stock[b].state_dict().items():
            if not k.endswith(ZERO_GRADIENT):
                err = max(err, rel_err(state[k], v))
    return err
