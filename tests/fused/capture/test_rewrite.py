"""The rewritten graph: shared values computed once, B-free, every node accounted for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from plait.fused.capture import SlotKind, rewrite
from plait.fused.errors import UnsupportedLayerError


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()  # built from shapes: shared
        scores = self.lin(x) @ x.transpose(1, 2)
        return scores.masked_fill(~causal, 0.0) * self.scale.sum()


def test_values_built_from_shapes_stay_shared_and_the_graph_has_no_b() -> None:
    model = Masked()
    ep = torch.export.export(model, (torch.randn(3, 5, 4),), strict=False)
    graph = rewrite(ep, model="Masked", layers=dict(model.named_modules()),
                    shared_buffers=frozenset({"scale"}))  # fmt: skip
    kinds = {s.name: s.kind for s in graph.slots}
    assert kinds["lin.weight"] is SlotKind.PARAMETER
    assert kinds["scale"] is SlotKind.SHARED_BUFFER
    # the mask's ones, tril and logical not are computed once, at capture: the fused
    # graph takes the mask as a constant and runs none of them
    (folded,) = (s.name for s in graph.slots if s.name.startswith("_folded_"))
    assert kinds[folded] is SlotKind.CONSTANT
    assert torch.equal(graph.constants[folded], ~torch.ones(5, 5, dtype=torch.bool).tril())
    targets = {str(n.target) for n in graph.module.graph.nodes if n.op == "call_function"}
    assert not targets & {"aten.ones.default", "aten.tril.default", "aten.bitwise_not.default"}
    # any B works: the rewrite never saw one
    for b in (2, 5):
        w, bias = torch.randn(b, 4, 4), torch.randn(b, 4)
        x = torch.randn(b, 3, 5, 4)
        values = {"lin.weight": w, "lin.bias": bias, "scale": torch.ones(4), **graph.constants}
        args = [values.get(s.name, x) for s in graph.slots]
        (out,) = graph.module(*args)
        assert out.shape == (b, 3, 5, 5)
        ref = torch.nn.functional.linear(x[1], w[1], bias[1]) @ x[1].transpose(1, 2)
        # one batched product against F.linear: fp32 sums of 4 terms in another order,
        # ~1e-6 relative on values up to ~20
        expected = ref.masked_fill(~torch.ones(5, 5).bool().tril(), 0) * 4
        assert torch.allclose(out[1], expected, rtol=1e-5, atol=1e-4)


def test_node_without_rule_is_named_with_its_layer() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(3, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.fft.rfft(self.inner(x), dim=-1).abs()

    model = Net()
    ep = torch.export.export(model, (torch.randn(2, 3),), strict=False)
    with pytest.raises(UnsupportedLayerError, match=r"Net: node 'fft_rfft' "
                       r"\(aten.fft_rfft.default\) in Net.forward"):  # fmt: skip
        rewrite(ep, model="Net", layers=dict(model.named_modules()))


class Attend(nn.Module):
    """Attention under a mask built from shapes, as transformers builds its masks."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        pos = torch.arange(t)
        if self.mask == "causal":
            mask = pos[None, :] <= pos[:, None]
        elif self.mask == "padding":  # nothing padded: every key visible
            mask = (pos >= 0)[None, :].expand(t, t)
        else:  # a window of two keys: a mask that hides some but is not causal
            mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 2)
        q = self.lin(x)[:, None]
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.parametrize(("mask", "causal", "kept"), [("causal", True, False),
                         ("padding", False, False), ("window", False, True)])  # fmt: skip
def test_attention_masks_known_at_capture_are_simplified(mask: str, causal: bool,
                                                         kept: bool) -> None:  # fmt: skip
    """A causal mask becomes `is_causal`, one that hides nothing is dropped, any other
    is passed as a constant; each array computes what the stock model does."""
    torch.manual_seed(0)
    models = [Attend(mask) for _ in range(2)]
    x = torch.randn(3, 6, 4)
    ep = torch.export.export(models[0], (x,), strict=False)
    graph = rewrite(ep, model="Attend", layers=dict(models[0].named_modules()))
    (attend,) = (n for n in graph.module.graph.nodes
                 if getattr(n.target, "__name__", "").startswith("fused_scaled_dot"))  # fmt: skip
    assert bool(attend.kwargs["is_causal"]) is causal
    assert (attend.kwargs["attn_mask"] is not None) is kept
    array = plait.fuse(models)
    xs = torch.randn(2, 3, 6, 4)
    out = array(xs)
    for b, m in enumerate(models):
        assert torch.allclose(out[b], m(xs[b]), atol=1e-6)
