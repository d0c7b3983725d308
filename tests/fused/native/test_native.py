from __future__ import annotations

import logging
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.fused import native
from plait.fused.native import build
from plait.fused.ops.attention import packed_attention
from plait.fused.ops.norm import FusedLayerNorm
from tests.fused.helpers import RTOL, rel_err, train_both

REASON = native.unavailable_reason()
needs_native = pytest.mark.skipif(REASON is not None, reason=f"native kernels: {REASON}")

# fp32 kernels against a float64 reference: a 16-term dot product or softmax sum in fp32
# rounds to a few ulps (~1e-7 each); 1e-5 relative leaves room for the longest sums here
# (32 keys, 64-wide rows) without letting a wrong index or a missing term through, which
# shows up at 1e-2 or more.
FP32_RTOL = 1e-5


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty library cache and no libraries loaded, restored afterwards."""
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path))
    saved = dict(build._libraries)
    build._libraries.clear()
    monkeypatch.setitem(build._state, "warned", False)
    yield tmp_path / "native"
    build._libraries.clear()
    build._libraries.update(saved)


def _reference_attention(qkv: torch.Tensor, heads: int, mask: torch.Tensor | None) -> torch.Tensor:
    q, k, v = (x.unflatten(-1, (heads, -1)).transpose(1, 2) for x in qkv.chunk(3, dim=-1))
    return F.scaled_dot_product_attention(q, k, v, mask).transpose(1, 2).flatten(2)


@needs_native
@pytest.mark.parametrize(("t", "d", "heads"), [(16, 8, 2), (5, 3, 3), (1, 4, 1), (32, 16, 2)])
@pytest.mark.parametrize("mask_heads", [None, 1, "all", "padding"])
def test_attention_kernel_matches_torch(t: int, d: int, heads: int, mask_heads: object) -> None:
    torch.manual_seed(0)
    batch = 6
    qkv = torch.randn(batch, t, 3 * heads * d, requires_grad=True)
    mask = None
    if mask_heads == 1:
        mask = torch.randn(batch, 1, t, t)
    elif mask_heads == "all":
        mask = torch.randn(batch, heads, t, t)
    elif mask_heads == "padding":  # -inf on the last key of every sequence but length-1 ones
        mask = torch.zeros(batch, 1, 1, t)
        if t > 1:
            mask[..., -1] = float("-inf")
    lib = native.attention_kernels(qkv, heads=heads, mask=mask)
    assert lib is not None
    ours = native.packed_attention(qkv, heads=heads, mask=mask, lib=lib)
    ref_in = qkv.detach().double().requires_grad_()
    ref = _reference_attention(ref_in, heads, None if mask is None else mask.double())
    g = torch.randn(ref.shape, dtype=torch.float64)
    (grad,) = torch.autograd.grad(ours, qkv, g.float())
    (ref_grad,) = torch.autograd.grad(ref, ref_in, g)
    assert rel_err(ours, ref) <= FP32_RTOL
    assert rel_err(grad, ref_grad) <= FP32_RTOL


@needs_native
@pytest.mark.parametrize("width", [1, 5, 16, 64])
@pytest.mark.parametrize(("weight", "bias"), [(True, True), (True, False), (False, False)])
def test_layer_norm_kernel_matches_torch(width: int, weight: bool, bias: bool) -> None:
    torch.manual_seed(0)
    models = 3
    x = (torch.randn(models, 4, 7, width) * 3 + 1).requires_grad_()
    w = torch.randn(models, width, requires_grad=True) if weight else None
    b = torch.randn(models, width, requires_grad=True) if bias else None
    lib = native.layer_norm_kernels(x, width=width, weight=w, bias=b)
    assert lib is not None
    ours = native.layer_norm(x, width=width, weight=w, bias=b, eps=1e-5, lib=lib)
    inputs = [t for t in (x, w, b) if t is not None]
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    ref = F.layer_norm(ref_inputs[0], (width,), None, None, 1e-5)
    if weight:
        ref = ref * ref_inputs[1].view(models, 1, 1, width)
    if bias:
        ref = ref + ref_inputs[2].view(models, 1, 1, width)
    g = torch.randn(ref.shape, dtype=torch.float64)
    grads = torch.autograd.grad(ours, inputs, g.float())
    ref_grads = torch.autograd.grad(ref, ref_inputs, g)
    assert rel_err(ours, ref) <= FP32_RTOL
    for a, r in zip(grads, ref_grads, strict=True):
        # width 1 normalises every row to 0: its input gradient is 0 up to rounding
        assert rel_err(a, r) <= FP32_RTOL or (width == 1 and a.abs().max() < 1e-5)


@needs_native
def test_threads_change_nothing_but_summation_order() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(64, 16, 48, requires_grad=True)
    x = torch.randn(4, 64, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            lib = native.attention_kernels(qkv, heads=2, mask=None)
            ln = native.layer_norm_kernels(x, width=16, weight=w, bias=None)
            assert lib is not None and ln is not None
            out = native.packed_attention(qkv, heads=2, mask=None, lib=lib)
            y = native.layer_norm(x, width=16, weight=w, bias=None, eps=1e-5, lib=ln)
            grads = torch.autograd.grad((out.square().sum() + y.square().sum()), (qkv, x, w))
            runs.append((out, y, *grads))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*runs, strict=True):
        # blocks and rows are independent; only the weight gradient's per-thread partial
        # sums are added in another order
        assert rel_err(a, b) <= 1e-6


@needs_native
@pytest.mark.parametrize("use_native", [True, False])
def test_transformer_layer_trains_like_stock_with_and_without_native(use_native: bool) -> None:
    def factory() -> nn.Module:
        return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                          norm_first=True)  # fmt: skip

    def feats(b: int) -> torch.Tensor:
        return torch.randn(b, 4, 16, 16)

    before = native.set_enabled(use_native)
    try:
        assert train_both(factory, feats) <= RTOL
    finally:
        native.set_enabled(before)


def test_kernels_apply_only_where_they_exist() -> None:
    qkv = torch.randn(2, 16, 48)
    before = native.set_enabled(False)
    try:
        assert native.attention_kernels(qkv, heads=2, mask=None) is None
        assert native.layer_norm_kernels(qkv, width=48, weight=None, bias=None) is None
    finally:
        native.set_enabled(before)
    for x in (qkv.double(), torch.randn(2, 33, 48), torch.randn(2, 4, 3 * 65)):
        assert native.attention_kernels(x, heads=1, mask=None) is None
    assert native.attention_kernels(qkv, heads=2, mask=torch.zeros(2, 1, 16, 16).double()) is None
    assert native.layer_norm_kernels(qkv, width=65, weight=None, bias=None) is None
    assert native.layer_norm_kernels(qkv.double(), width=48, weight=None, bias=None) is None


def test_float64_layer_norm_keeps_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**sizes: int) -> None:
        raise AssertionError(f"native kernels asked for on float64 ({sizes})")

    monkeypatch.setattr("plait.fused.native.functions.load", refuse)
    fused = FusedLayerNorm.from_modules([nn.LayerNorm(8).double() for _ in range(2)])
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    ref = torch.stack([F.layer_norm(x[i], (8,)) for i in range(2)])
    assert rel_err(fused(x), ref) <= 1e-12


def test_switched_off_by_environment() -> None:
    code = "from plait.fused import native; print(native.enabled())"
    env = {"PLAIT_NATIVE": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip() == "False"


@needs_native
def test_built_once_then_loaded_from_the_cache(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert build.load(SEQ=4, HEAD=2) is not None
    assert len(list(fresh_cache.glob("kernels-*.so"))) == 1
    assert not list(fresh_cache.glob(".*.tmp"))  # the temporary file was renamed away

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached library was rebuilt")

    build._libraries.clear()
    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert build.load(SEQ=4, HEAD=2) is not None
    with pytest.raises(AssertionError, match="rebuilt"):
        build.load(SEQ=4, HEAD=3)  # another size is another library


@needs_native
def test_failed_build_falls_back_with_one_warning(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(build, "compiler", lambda: "/bin/false")
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load(SEQ=4, HEAD=2) is None
        assert build.load(SEQ=5, HEAD=2) is None
    warnings = [r for r in caplog.records if "native kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "exited 1" in warnings[0].getMessage()
    assert not list(fresh_cache.glob("*"))
    # the layers keep working on torch's kernels
    qkv = torch.randn(3, 4, 12, requires_grad=True)
    out = packed_attention(qkv, heads=2, mask=None)
    assert rel_err(out, _reference_attention(qkv, 2, None)) <= FP32_RTOL
    assert math.isfinite(out.sum().item())


@needs_native
def test_adam_in_place_matches_stock_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.fused import FusedAdam

    calls = []
    real = native.adam_step
    monkeypatch.setattr(native, "adam_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    lrs = [0.01, 0.03, 0.002]
    stock = [nn.Linear(5, 4) for _ in lrs]
    fused = [nn.Parameter(torch.stack([getattr(m, n).detach() for m in stock]).clone())
             for n in ("weight", "bias")]  # fmt: skip
    opt = FusedAdam(fused, lr=lrs)
    stock_opts = [torch.optim.Adam(m.parameters(), lr=lr) for m, lr in zip(stock, lrs, strict=True)]
    for _ in range(10):
        x = torch.randn(len(lrs), 6, 5)
        opt.zero_grad()
        (torch.baddbmm(fused[1].unsqueeze(1), x, fused[0].transpose(1, 2)).tanh().sum()).backward()
        opt.step()
        for b, (m, o) in enumerate(zip(stock, stock_opts, strict=True)):
            o.zero_grad()
            m(x[b]).tanh().sum().backward()
            o.step()
    assert len(calls) == 10  # every step took the in-place kernel
    for b, m in enumerate(stock):
        assert rel_err(fused[0][b], m.weight) <= RTOL
        assert rel_err(fused[1][b], m.bias) <= RTOL


@needs_native
def test_adam_in_place_counts_as_an_in_place_change() -> None:
    from plait.fused import FusedAdam

    w = nn.Parameter(torch.randn(2, 3, 4))
    opt = FusedAdam([w], lr=[0.1, 0.2])
    x = torch.randn(2, 5, 4, requires_grad=True)
    loss = torch.bmm(x, w.transpose(1, 2)).sum()  # saves w for x's gradient
    w.grad = torch.ones_like(w)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _heads_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """torch's attention with k and v repeated per query head; a fully masked row gives
    zeros (torch's kernel gives NaN there, plait's the zeros its math path gives)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal).nan_to_num()


@needs_native
@pytest.mark.parametrize(
    ("heads", "kv_heads", "t", "d"), [(2, 2, 32, 16), (4, 2, 32, 8), (2, 1, 7, 5), (2, 2, 64, 16)]
)
@pytest.mark.parametrize("masking", ["none", "causal", "additive", "causal+additive"])
def test_heads_attention_kernel_matches_torch(
    heads: int, kv_heads: int, t: int, d: int, masking: str
) -> None:
    torch.manual_seed(0)
    nb = 5
    # q as a captured model holds it: a transposed view of a [nb, t, heads, d] projection
    q = torch.randn(nb, t, heads, d).transpose(1, 2).requires_grad_()
    k = torch.randn(nb, kv_heads, t, d, requires_grad=True)
    v = torch.randn(nb, kv_heads, t, d, requires_grad=True)
    mask = None
    if "additive" in masking:
        mask = torch.randn(nb, 1, t, t)
        mask[:, :, 0, :] = float("-inf")  # the first query sees nothing
    causal = "causal" in masking
    lib = native.attention_heads_kernels(q, k, v, mask)
    assert lib is not None
    ours = native.attention_heads(q, k, v, mask=mask, causal=causal, dropout=None,
                                  scale=d**-0.5, lib=lib)  # fmt: skip
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = _heads_reference(*inputs, None if mask is None else mask.double(), causal)
    g = torch.randn(ref.shape, dtype=torch.float64)
    grads = torch.autograd.grad(ours, (q, k, v), g.float())
    ref_grads = torch.autograd.grad(ref, inputs, g)
    assert rel_err(ours, ref) <= FP32_RTOL
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert rel_err(grad, ref_grad) <= FP32_RTOL
    # the gradient of q comes laid out as q, so the view q came through takes it as is
    assert grads[0].stride() == q.stride()


@needs_native
def test_heads_attention_dropout_per_model_and_its_gradient() -> None:
    """Dropout inside the kernel: a model at p = 0 keeps every probability, one at 0.5
    drops about half (values of 1 average to 1 either way), and the backward, which
    recomputes the mask from the seed, is the gradient of the forward (finite
    differences, in float64 arithmetic on the same seed)."""
    torch.manual_seed(0)
    nb, heads, t, d = 16, 2, 32, 16
    q, k = torch.randn(nb, heads, t, d), torch.randn(nb, heads, t, d)
    ones = torch.ones(nb, heads, t, d)
    lib = native.attention_heads_kernels(q, k, ones, None)
    assert lib is not None
    out = native.attention_heads(q, k, ones, mask=None, causal=True, dropout=[0.0] * 4 + [0.5] * 4,
                                 scale=0.25, lib=lib)  # fmt: skip
    # 16 rows in 8 models of 2: rows 0-7 are models 0-3, at p = 0
    assert torch.allclose(out[:8], torch.ones_like(out[:8]), rtol=1e-6)
    dropped = out[8:]
    assert not torch.equal(dropped, torch.ones_like(dropped))
    assert abs(float(dropped.mean()) - 1.0) < 0.05  # 16k outputs of a mean-1 estimate

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1)  # the seed the kernel draws its mask from
        return native.attention_heads(q, k, v, mask=None, causal=True, dropout=[0.3],
                                      scale=0.25, lib=lib)  # fmt: skip

    inputs = [torch.randn(nb, heads, t, d, requires_grad=True) for _ in range(3)]
    g = torch.randn(nb, t, heads, d).transpose(1, 2)
    grads = torch.autograd.grad(run(*inputs), inputs, g)
    eps = 1e-2
    for i, grad in enumerate(grads):
        direction = torch.randn(nb, heads, t, d)
        with torch.no_grad():
            up = [x + eps * direction if j == i else x for j, x in enumerate(inputs)]
            down = [x - eps * direction if j == i else x for j, x in enumerate(inputs)]
            numeric = float(((run(*up) - run(*down)) * g).sum()) / (2 * eps)
        # central differences of a smooth function at eps 1e-2 in fp32: ~1e-4 relative
        assert math.isclose(float((grad * direction).sum()), numeric, rel_tol=2e-3)


@needs_native
def test_heads_attention_kernels_refuse_what_they_cannot_serve() -> None:
    q = torch.randn(2, 2, 8, 4)
    assert native.attention_heads_kernels(q, q, q, None) is not None
    assert native.attention_heads_kernels(q.double(), q.double(), q.double(), None) is None
    assert native.attention_heads_kernels(q, q[:, :, :4], q[:, :, :4], None) is None  # cross
    assert (
        native.attention_heads_kernels(
            q,
            q[:, :1].expand(2, 3, 8, 4).contiguous(),
            q[:, :1].expand(2, 3, 8, 4).contiguous(),
            None,
        )
        is None
    )
    assert native.attention_heads_kernels(q.transpose(2, 3), q, q, None) is None  # rows strided
    long = torch.randn(1, 1, native.functions.MAX_HEADS_SEQ + 1, 4)
    assert native.attention_heads_kernels(long, long, long, None) is None


@needs_native
def test_gelu_tanh_kernel_matches_torch() -> None:
    """Forward and backward of the tanh form against float64 torch over the whole range
    (large |x| saturates the sigmoid); the exact form is not served."""
    torch.manual_seed(0)
    x = torch.cat([torch.linspace(-12, 12, 20001), 3 * torch.randn(5000)]).requires_grad_()
    lib = native.gelu_kernels(x, approximate="tanh")
    assert lib is not None
    assert native.gelu_kernels(x, approximate="none") is None
    assert native.gelu_kernels(x.double(), approximate="tanh") is None
    ours = native.gelu(x, lib=lib)
    ref_in = x.detach().double().requires_grad_()
    ref = F.gelu(ref_in, approximate="tanh")
    g = torch.randn(ref.shape, dtype=torch.float64)
    (grad,) = torch.autograd.grad(ours, x, g.float())
    (ref_grad,) = torch.autograd.grad(ref, ref_in, g)
    # element-wise, so judged per element against the largest value: a few fp32 ulps of
    # 12 (the largest output) is ~1e-6 absolute, 1e-7 relative to it
    assert float((ours.double() - ref).abs().max()) <= 1e-6 * 12
    assert float((grad.double() - ref_grad).abs().max()) <= 1e-6 * float(g.abs().max())


@needs_native
@pytest.mark.parametrize("width", [5, 8, 32, 64])
def test_rms_norm_kernel_matches_torch(width: int) -> None:
    """The layer-norm kernel without centring is `F.rms_norm` with each model's scale.
    (Not at width 1: x / |x| has a zero gradient there, which float32 gets as the
    difference of two equal terms, so no relative error is meaningful.)"""
    torch.manual_seed(0)
    models = 3
    x = torch.randn(models, 10, width, requires_grad=True)
    weight = (torch.rand(models, width) + 0.5).requires_grad_()
    lib = native.layer_norm_kernels(x, width=width, weight=weight, bias=None)
    assert lib is not None
    ours = native.layer_norm(x, width=width, weight=weight, bias=None, eps=1e-6, lib=lib,
                             centred=False)  # fmt: skip
    ref_x, ref_w = (t.detach().double().requires_grad_() for t in (x, weight))
    ref = F.rms_norm(ref_x, [width], None, 1e-6) * ref_w[:, None, :]
    g = torch.randn(ref.shape, dtype=torch.float64)
    grads = torch.autograd.grad(ours, (x, weight), g.float())
    ref_grads = torch.autograd.grad(ref, (ref_x, ref_w), g)
    assert rel_err(ours, ref) <= FP32_RTOL
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert rel_err(grad, ref_grad) <= FP32_RTOL


@needs_native
def test_rotary_kernel_matches_its_torch_definition() -> None:
    """`plait::rotary` on the kernel against its definition in torch operators (float64),
    forward and backward, with cos and sin broadcast over batch and heads."""
    from plait.fused.native import ops

    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 8, requires_grad=True)
    cos, sin = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    lib = native.rotary_kernels(x, cos, sin)
    assert lib is not None
    assert native.rotary_kernels(x[..., :7], cos[..., :7], sin[..., :7]) is None  # odd width
    ours = native.rotary(x, cos, sin, lib=lib)
    ref_in = x.detach().double().requires_grad_()
    ref = ops.rotary_reference(ref_in, cos.double(), sin.double())
    g = torch.randn(ref.shape, dtype=torch.float64)
    (grad,) = torch.autograd.grad(ours, x, g.float())
    (ref_grad,) = torch.autograd.grad(ref, ref_in, g)
    assert rel_err(ours, ref) <= FP32_RTOL
    assert rel_err(grad, ref_grad) <= FP32_RTOL
