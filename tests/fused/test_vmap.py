"""VmapArray: models `plait.fuse` cannot rewrite, Hugging Face `transformers` ones included.

Tiny GPT-2, BERT, Llama and ResNet models are built from configs (no weights are
downloaded); N of them trained as a vmap array must match N stock models trained one by
one, with plait's fused optimizers against torch.optim.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import plait
from plait.fused import FusedAdam, FusedSGD, UnsupportedLayerError, VmapArray
from plait.fused.vmap import disable_caches, tied_parameters
from tests.fused.helpers import RTOL, build, rel_err

transformers = pytest.importorskip("transformers")

# vmap has no batching rule for CPU flash attention and loops over models there (slower,
# same result), which torch reports on every call.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

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


def classified_tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, VOCAB, (B, 4, 8), generator=g),
        "labels": torch.randint(0, 3, (B, 4), generator=g),
    }


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

# BERT's attention key bias adds the same number to every score of a query, which the
# softmax removes: its exact gradient is zero and both runs step it by rounding noise
# alone, with no effect on any output. It is left out of the comparison.
ZERO_GRADIENT = ("attention.self.key.bias",)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_model_trains_like_stock(name: str, optimizer: str) -> None:
    factory, batch = MODELS[name]
    with pytest.raises(UnsupportedLayerError, match="fallback='vmap'"):
        plait.fuse(factory, n=B)
    stock = build(factory, B)
    array = plait.fuse(build(factory, B), fallback="vmap")
    assert isinstance(array, VmapArray)
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
    for _ in range(10):
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
    assert err <= RTOL


def test_outputs_keep_their_type_and_caches_are_off() -> None:
    array = plait.fuse(llama, n=B, fallback="vmap")
    out = array(torch.randint(0, VOCAB, (B, 3, 5)))
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert out.logits.shape == (B, 3, 5, VOCAB)
    assert out.past_key_values is None


def test_tied_weights_are_one_parameter_under_both_names() -> None:
    assert tied_parameters(gpt2()) == {"lm_head.weight": "transformer.wte.weight"}
    array = plait.fuse(gpt2, n=B, fallback="vmap")
    assert array.get_parameter("lm_head.weight") is array.get_parameter("transformer.wte.weight")
    assert sum(p is array.get_parameter("lm_head.weight") for p in array.parameters()) == 1
    stock = build(gpt2, B)
    array.load_models(stock)
    array.keep([1])
    assert array.get_parameter("lm_head.weight") is array.get_parameter("transformer.wte.weight")
    assert torch.equal(
        array.to_models()[0]["lm_head.weight"], stock[1].get_parameter("lm_head.weight")
    )


def test_disable_caches_names_the_changed_modules() -> None:
    model = llama()
    assert disable_caches(model) == ["LlamaForCausalLM"]
    assert getattr(model, "config").use_cache is False  # noqa: B009
    assert disable_caches(model) == []


def test_padding_rows_get_no_gradient_in_any_model() -> None:
    factory: Callable[[], nn.Module] = lambda: nn.Embedding(5, 2, padding_idx=1)  # noqa: E731
    models = build(factory, 3)
    last = models[2]
    assert isinstance(last, nn.Embedding)
    last.padding_idx = 0  # per-model padding indices are allowed
    array = VmapArray(models)
    weight = array.get_parameter("weight")
    array(torch.tensor([[0, 1, 2]] * 3)).sum().backward()
    grad = weight.grad
    assert grad is not None
    assert grad[0, 1].abs().sum() == 0 and grad[1, 1].abs().sum() == 0
    assert grad[2, 0].abs().sum() == 0 and grad[2, 1].abs().sum() > 0
    array.keep([2])
    weight.grad = None
    array(torch.tensor([[0, 1, 2]])).sum().backward()
    assert weight.grad is not None and weight.grad[0, 0].abs().sum() == 0
