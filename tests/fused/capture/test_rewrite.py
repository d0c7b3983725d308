"""The rewritten graph: shared values computed once, B-free, every node accounted for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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
    fused = {n.name for n in graph.module.graph.nodes if n.op == "call_function"
             and getattr(n.target, "__name__", "").startswith(("batched_", "fused_"))}  # fmt: skip
    # the mask's ones, tril and logical not run once, unchanged: aten ops, not rules
    untouched = [n for n in graph.module.graph.nodes if n.op == "call_function"
                 and n.name not in fused]  # fmt: skip
    assert {str(n.target) for n in untouched} >= {"aten.ones.default", "aten.tril.default"}
    # any B works: the rewrite never saw one
    for b in (2, 5):
        w, bias = torch.randn(b, 4, 4), torch.randn(b, 4)
        x = torch.randn(b, 3, 5, 4)
        values = {"lin.weight": w, "lin.bias": bias, "scale": torch.ones(4)}
        args = [values.get(s.name, x) for s in graph.slots]
        (out,) = graph.module(*args)
        assert out.shape == (b, 3, 5, 5)
        ref = torch.nn.functional.linear(x[1], w[1], bias[1]) @ x[1].transpose(1, 2)
        assert torch.allclose(out[1], ref.masked_fill(~torch.ones(5, 5).bool().tril(), 0) * 4)


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
