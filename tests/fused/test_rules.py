"""Batching rules: one model's call rewritten for [B, ...] values, checked per model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.fused.errors import UnsupportedLayerError
from plait.fused.rules import batched_call, method


def test_elementwise_broadcasts_lower_rank_operands_behind_the_model_dim() -> None:
    a, b = torch.randn(3, 4), torch.randn(3, 2, 5, 4)  # per model: [4] + [2, 5, 4]
    impl, batched = batched_call(
        torch.add, is_method=False, args=(a, b), fa=(True, True), fk={}, where="f"
    )
    out = impl(a, b)
    assert batched
    for m in range(3):
        torch.testing.assert_close(out[m], torch.add(a[m], b[m]))


@pytest.mark.parametrize(("dim", "keepdim"), [(-1, False), (0, True), (None, False)])
def test_reductions_shift_dims_and_reduce_everything_but_the_model(
    dim: int | None, keepdim: bool
) -> None:
    x = torch.randn(3, 4, 5)
    kwargs: dict[str, Any] = {} if dim is None else {"dim": dim, "keepdim": keepdim}
    flags = {k: False for k in kwargs}
    impl, _ = batched_call(torch.sum, is_method=False, args=(x,), fa=(True,), fk=flags, where="f")
    out = impl(x, **kwargs)
    for m in range(3):
        torch.testing.assert_close(out[m], torch.sum(x[m], **kwargs))


def test_method_views_gain_the_model_dim_and_sizes_stay_shared() -> None:
    x = torch.randn(2, 3, 4)
    impl, batched = batched_call(
        "view", is_method=True, args=(x, 12), fa=(True, False), fk={}, where="f"
    )
    assert batched and impl(x, 12).shape == (2, 12)
    size, size_batched = batched_call(
        "size", is_method=True, args=(x, -1), fa=(True, False), fk={}, where="f"
    )
    assert not size_batched and size(x, -1) == 4
    assert method("size")(x[0], 0) == 3


def test_unknown_call_names_itself_and_where_it_was_called() -> None:
    with pytest.raises(
        UnsupportedLayerError, match=r"einsum \(called in Net.forward\) cannot be fused"
    ):
        batched_call(
            torch.einsum, is_method=False, args=("i->i",), fa=(False,), fk={}, where="Net.forward"
        )


def test_dim_ops_refuse_per_model_dims() -> None:
    x = torch.randn(2, 3)
    with pytest.raises(UnsupportedLayerError, match="per-model tensors beyond its input"):
        batched_call(torch.sum, is_method=False, args=(x, x), fa=(True, True), fk={}, where="f")
