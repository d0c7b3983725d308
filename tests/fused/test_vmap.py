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

from plait.fused import VmapArray
from plait.fused.vmap import disable_caches, tied_parameters
from tests.fused.helpers import RTOL, build

pytest.importorskip("transformers")

from tests.fused.hf_models import MODELS, VOCAB, B, gpt2, llama, train_like_stock

# vmap has no batching rule for CPU flash attention and loops over models there (slower,
# same result), which torch reports on every call.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_model_trains_like_stock(name: str, optimizer: str) -> None:
    factory, batch = MODELS[name]
    assert train_like_stock(VmapArray(build(factory, B)), factory, batch, optimizer) <= RTOL


def test_outputs_keep_their_type_and_caches_are_off() -> None:
    array = VmapArray(build(llama, B))
    out = array(torch.randint(0, VOCAB, (B, 3, 5)))
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert out.logits.shape == (B, 3, 5, VOCAB)
    assert out.past_key_values is None


def test_tied_weights_are_one_parameter_under_both_names() -> None:
    assert tied_parameters(gpt2()) == {"lm_head.weight": "transformer.wte.weight"}
    array = VmapArray(build(gpt2, B))
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
