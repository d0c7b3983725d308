"""CapturedArray on transformers' GPT-2, BERT, Llama and ResNet built from configs.

Each model is captured with torch.export and fused (no vmap), 2 models are trained 10
steps with plait's fused SGD and Adam against 2 stock models and torch.optim, and each
member goes back to a stock model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from plait.fused import CapturedArray, FusedSGD, StructureMismatchError, UnsupportedLayerError
from plait.fused.capture import array as capture_array
from plait.fused.ops import conv as fused_conv
from tests.fused.helpers import RTOL, build, rel_err

pytest.importorskip("transformers")

from tests.fused.hf_models import PADDED, VOCAB, B, gpt2, resnet, train_like_stock


def captured(factory: object, inputs: dict[str, torch.Tensor]) -> CapturedArray:
    array = plait.fuse(build(factory, B))  # type: ignore[arg-type]
    assert isinstance(array, CapturedArray)
    assert array.capture(**inputs) is not None  # fused, not the vmap fallback
    return array


#: `make test` trains one case per mechanism: GPT-2 (Conv1D, tied embeddings, causal and
#: padding masks, GELU-tanh) under Adam and ResNet (convolutions, batch norm, max
#: pooling) under SGD; each export costs seconds, so Llama and BERT and the other
#: optimizer run under `make test-all` (operator rules have their own short tests).
FAST = {("gpt2", "adam"), ("resnet", "sgd"), ("gpt2", None)}


def _cases(optimizers: list[str | None]) -> list[object]:
    return [
        pytest.param(*(n, o) if o else (n,), id=f"{n}-{o}" if o else n,
                     marks=() if (n, o) in FAST else pytest.mark.slow)
        for n in PADDED for o in optimizers
    ]  # fmt: skip


@pytest.mark.parametrize(("name", "optimizer"), _cases(["sgd", "adam"]))
def test_each_member_trains_like_its_stock_model(name: str, optimizer: str) -> None:
    factory, batch = PADDED[name]
    array = captured(factory, batch(torch.Generator().manual_seed(7)))
    assert train_like_stock(array, factory, batch, optimizer) <= RTOL


@pytest.mark.parametrize("name", _cases([None]))
def test_members_go_back_to_stock_models(name: str) -> None:
    factory, batch = PADDED[name]
    inputs = batch(torch.Generator().manual_seed(3))
    array = captured(factory, inputs)
    array.eval()
    with torch.no_grad():
        out = array(**inputs)
        for b, model in enumerate(array.to_modules()):
            assert type(model) is type(build(factory, 1)[0])
            model.eval()
            ref = model(**{k: v[b] for k, v in inputs.items()})
            assert rel_err(out.logits[b], ref.logits) <= RTOL
            assert rel_err(out.loss[b], ref.loss) <= RTOL
    config = getattr(array.to_modules()[0], "config", None)
    if config is not None and hasattr(config, "use_cache") and name != "bert":
        assert config.use_cache  # the array turned caches off; the exports have them back


def test_graphs_are_cached_per_model_and_input_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    capture_array.clear_cache()
    exports = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real(*a, **k))
    ids = torch.randint(0, VOCAB, (B, 3, 8))
    first = plait.fuse(gpt2, n=B)
    first(input_ids=ids)
    first(input_ids=ids)
    plait.fuse(gpt2, n=B)(input_ids=ids)  # another array of the same model: no export
    assert len(exports) == 1
    first(input_ids=ids[:, :2])  # another per-model batch size is another signature
    first.eval()
    first(input_ids=ids)  # so is eval mode
    assert len(exports) == 3


def test_keep_prunes_a_captured_array() -> None:
    factory, batch = PADDED["gpt2"]
    inputs = batch(torch.Generator().manual_seed(1))
    three = [*build(factory, B), build(factory, 1, seed=5)[0]]
    array = plait.fuse(three)
    array.eval()
    wide = {k: torch.cat([v, v[:1]]) for k, v in inputs.items()}
    with torch.no_grad():
        before = array(**wide).logits
        array.keep([2, 0])
        after = array(**{k: v[[2, 0]] for k, v in wide.items()}).logits
    assert rel_err(after, before[[2, 0]]) <= RTOL


def test_per_model_dropout_and_padding_index() -> None:
    models = build(gpt2, B)
    for m, p in zip(models, (0.0, 0.5), strict=True):
        for layer in m.modules():
            if isinstance(layer, nn.Dropout):
                layer.p = p
    array = plait.fuse(models)
    ids = torch.randint(0, VOCAB, (B, 4, 8))
    out = array(input_ids=ids, labels=ids)
    ref = models[0](input_ids=ids[0], labels=ids[0])
    assert rel_err(out.loss[0], ref.loss) <= RTOL  # model 0 drops nothing
    assert array.to_modules()[1].transformer.drop.p == 0.5  # type: ignore[union-attr]


def test_batch_norm_keeps_each_models_statistics() -> None:
    factory, batch = PADDED["resnet"]
    inputs = batch(torch.Generator().manual_seed(2))
    array = captured(factory, inputs)
    stock = build(factory, B)
    array(**inputs).loss.sum().backward()
    for b, m in enumerate(stock):
        m(**{k: v[b] for k, v in inputs.items()})
        for name, buf in m.named_buffers():
            assert rel_err(array.get_buffer(name)[b].double(), buf.double()) <= RTOL, name


def test_members_must_share_their_configuration() -> None:
    models = build(resnet, 1) + build(resnet, 1)
    models[1].config.hidden_act = "gelu"  # type: ignore[union-attr]
    with pytest.raises(StructureMismatchError, match="model 1 differs from model 0"):
        plait.fuse(models)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h[h > 0].sum() * h


class Spectral(nn.Module):
    """A layer with no fused form (an FFT) that torch.func's vmap runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(self.lin(x), dim=-1).abs()


def test_unfusable_node_is_named_and_the_fallback_offered() -> None:
    x = torch.randn(B, 4, 3)
    with pytest.raises(UnsupportedLayerError, match=r"DataDependent: node '.*' \(aten\..*\).*"
                       r"per-model values.*fallback='vmap'"):  # fmt: skip
        plait.fuse(DataDependent, n=B)(x)
    with pytest.raises(UnsupportedLayerError, match=r"node '.*' \(aten.fft_rfft.default\) in "
                       r"Spectral.forward cannot be fused"):  # fmt: skip
        plait.fuse(Spectral, n=B)(x)
    array = plait.fuse(build(Spectral, B), fallback="vmap")
    out = array(x)
    for b, m in enumerate(build(Spectral, B)):
        assert rel_err(out[b], m(x[b])) <= RTOL
    opt = FusedSGD(array.parameters(), lr=0.1)
    out.sum().backward()
    opt.step()


def test_a_converted_array_captures_and_exports_in_its_new_dtype() -> None:
    """`.double()` after fusing: the captured model and the exported members follow the
    array's dtype (the stock template keeps the dtype the models were built in)."""
    factory, batch = PADDED["resnet"]
    inputs = batch(torch.Generator().manual_seed(4))
    inputs["pixel_values"] = inputs["pixel_values"].double()
    array = plait.fuse(build(factory, B)).double()
    array.eval()
    with torch.no_grad():
        out = array(**inputs)
        assert out.logits.dtype == torch.float64
        for b, (model, stock) in enumerate(zip(array.to_modules(), build(factory, B), strict=True)):
            assert all(p.dtype == torch.float64 for p in model.parameters())
            ref = stock.double().eval()(**{k: v[b] for k, v in inputs.items()})
            # float64 end to end: only float64 rounding of differently ordered sums.
            assert rel_err(out.logits[b], ref.logits) <= 1e-12


def test_resnet_on_small_images_takes_the_window_product(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8x8 images reach 1x1 maps in the second stage: its convolutions (3x3 over 2x2 at
    # stride 2, 3x3 over 1x1, the 1x1 shortcut) have one output position each and run as
    # batched products; the members must still train like stock models
    calls: list[int] = []
    original = fused_conv._WindowProduct.apply

    def counted(*args: object) -> object:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(fused_conv._WindowProduct, "apply", counted)

    def small(g: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "pixel_values": torch.randn(B, 4, 3, 8, 8, generator=g),
            "labels": torch.randint(0, 3, (B, 4), generator=g),
        }

    array = captured(resnet, small(torch.Generator().manual_seed(7)))
    assert train_like_stock(array, resnet, small, "adam") <= RTOL
    assert len(calls) >= 3 * 10  # three such convolutions a step, ten steps
