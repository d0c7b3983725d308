"""Rules for the ATen operators that carry a layer's parameters: the fused layers' kernels.

In a captured graph a layer is an operator whose weight is a batched graph input. Each
rule here calls the function the fused layer of `plait.fused.ops` runs, so a captured
model trains exactly as the same layers fused by module would:

- `linear` -> one batched matmul with each model's bias (`ops.linear.linear`), and
  transformers' Conv1D (`addmm` of a [in, out] weight) -> the same with the weight as
  stored (`ops.linear.addmm`);
- `embedding` -> one lookup in the [B*V, D] table, with each model's padding index
  (tied weights need nothing more: the tie is one graph input used twice);
- convolutions -> one grouped convolution; batch norm -> one batch norm over B*C
  channels whose running statistics are each model's own (train mode per model);
- layer norm, group norm, RMSNorm -> one normalisation and each model's affine;
- `scaled_dot_product_attention` with a causal flag or a boolean/additive mask, shared or
  per model -> one attention call over B*N batch entries, on the native attention kernel
  (`native.attention_heads`, dropout of the probabilities inside) where it applies;
- dropout -> one draw, each model at the probability of its own layer;
- GELU's tanh form and the rotary embedding (`plait::rotary`) -> the native kernels where
  they apply;
- losses (cross-entropy, NLL, MSE, ...) with "mean" or "sum" reduction -> one loss per
  model, [B], as the model's own `ModelOutput.loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from plait.fused import native
from plait.fused.capture.rules import Call, Rewrite, Rule, named, pointwise, product_sum
from plait.fused.native import ops as native_ops
from plait.fused.ops.base import expand_models
from plait.fused.ops.conv import conv
from plait.fused.ops.dropout import dropout as model_dropout
from plait.fused.ops.embedding import lookup
from plait.fused.ops.linear import addmm as batched_addmm
from plait.fused.ops.linear import linear as batched_linear
from plait.fused.ops.norm import batch_norm, group_norm, layer_norm
from plait.fused.ops.norm import rms_norm as fused_rms_norm
from plait.fused.ops.pooling import max_pool2d, max_pool2d_with_indices, per_channel
from plait.fused.rules import align

aten = torch.ops.aten


def _models(kw: dict[str, Any], names: Sequence[str]) -> int:
    return next(int(kw[k].shape[0]) for k in names if isinstance(kw.get(k), torch.Tensor))


def _to_models(call: Call, kw: dict[str, Any], names: Sequence[str], b: int) -> None:
    """Expand the shared tensors among `names` to all B models (views, no copies)."""
    for k in names:
        if not call.batched(k) and isinstance(kw.get(k), torch.Tensor):
            kw[k] = expand_models(kw[k], b)


def _batched_names(call: Call, names: Sequence[str]) -> list[str]:
    return [k for k in names if call.batched(k)]


def _per_sample(op: Any, first: str) -> Callable[..., Any]:
    """An op that treats leading dims as samples: B joins the per-model batch."""

    def impl(**kw: Any) -> Any:
        x = kw[first]
        kw[first] = x.flatten(0, 1)
        return op(**kw).unflatten(0, (x.shape[0], x.shape[1]))

    return impl


def _input(call: Call, kw: dict[str, Any], b: int) -> torch.Tensor:
    """The call's `input` as [B, ...]: an input shared by all models is expanded to B."""
    x: torch.Tensor = kw["input"]
    return x if call.batched("input") else expand_models(x, b)


def _bias(call: Call, kw: dict[str, Any], b: int) -> torch.Tensor | None:
    """The call's `bias` as [B, ...] (a bias shared by all models expanded), or None."""
    bias: torch.Tensor | None = kw["bias"]
    if bias is not None and not call.batched("bias"):
        bias = bias.expand(b, *bias.shape)
    return bias


# ------------------------------------------------------------------------------ layers


def linear(call: Call) -> Rewrite:
    if not call.batched("weight"):
        if call.batched("bias"):
            raise call.unsupported("a per-model bias with a shared weight cannot be fused")
        return Rewrite(call.op)  # shared weights: leading dims are samples already

    def impl(**kw: Any) -> Any:
        b = int(kw["weight"].shape[0])
        x = _input(call, kw, b)
        bias = _bias(call, kw, b)
        return batched_linear(x, kw["weight"], bias)

    return Rewrite(named(impl, call.op, "fused"))


def addmm(call: Call) -> Rewrite:
    """`bias + x @ w`: transformers' Conv1D when the weight is per model."""
    if not call.batched("mat2") or call.args["beta"] != 1 or call.args["alpha"] != 1:
        return product_sum(("self", "mat1", "mat2"))(call)

    def impl(**kw: Any) -> Any:
        b = int(kw["mat2"].shape[0])
        x = kw["mat1"] if call.batched("mat1") else expand_models(kw["mat1"], b)
        return batched_addmm(kw["self"], x, kw["mat2"])

    return Rewrite(named(impl, call.op, "fused"))


def embedding(call: Call) -> Rewrite:
    if call.args["scale_grad_by_freq"] or call.args["sparse"]:
        raise call.unsupported("embedding with scale_grad_by_freq or sparse cannot be fused")
    if not call.batched("weight"):
        return Rewrite(call.op)  # one table for all models: any index shape works
    # Each model's own padding index when the node is an nn.Embedding's (they may differ),
    # otherwise the one the graph recorded.
    settings = {"padding": (nn.Embedding, "padding_idx")}
    recorded = int(call.args["padding_idx"])

    def impl(**kw: Any) -> Any:
        weight, idx = kw["weight"], kw["indices"]
        b = int(weight.shape[0])
        if not call.batched("indices"):
            idx = expand_models(idx, b)
        pads = kw.pop("padding", None)
        if pads is None:
            pads = [None if recorded < 0 else recorded] * b
        return lookup(weight, idx, list(pads))

    return Rewrite(named(impl, call.op, "fused"), settings=settings)


def convolution(call: Call) -> Rewrite:
    """conv1d/2d/3d (and `convolution` when not transposed) with per-model filters."""
    if call.args.get("transposed"):
        raise call.unsupported("transposed convolutions are fused as nn.ConvTranspose layers only")
    if not call.batched("weight"):
        if call.batched("bias"):
            raise call.unsupported("a per-model bias with shared filters cannot be fused")
        return Rewrite(named(_per_sample(call.op, "input"), call.op))

    def impl(**kw: Any) -> Any:
        b = int(kw["weight"].shape[0])
        x = _input(call, kw, b)
        bias = _bias(call, kw, b)
        return conv(x, kw["weight"], bias, stride=kw["stride"], padding=kw["padding"],
                    dilation=kw["dilation"], groups=int(kw["groups"]))  # fmt: skip

    return Rewrite(named(impl, call.op, "fused"))


_PARAMS = ("weight", "bias")
_STATS = ("running_mean", "running_var")


def batch_norm_rule(call: Call) -> Rewrite:
    """Batch norm: each model normalises by its own batch's statistics and keeps its own
    running statistics (in train mode they are updated in place, per model)."""
    if call.args["training"] and any(
        call.args[k] is not None and not call.batched(k) for k in _STATS
    ):
        raise call.unsupported("running statistics shared by all models cannot be updated")

    def impl(**kw: Any) -> Any:
        x = kw["input"]
        b = _models(kw, ["input", *_PARAMS, *_STATS])
        if not call.batched("input"):
            x = expand_models(x, b)
        params = [_per_model_copy(call, kw[k], k, b) for k in (*_PARAMS, *_STATS)]
        return batch_norm(x, *params, training=bool(kw["training"]),
                          momentum=float(kw["momentum"]), eps=float(kw["eps"]))  # fmt: skip

    return Rewrite(named(impl, call.op, "fused"))


def _per_model_copy(call: Call, t: torch.Tensor | None, name: str, b: int) -> Any:
    """`t` as [B, ...]: a shared tensor is copied to every model (kernels that view it
    flat need real memory; its gradient still sums over the copies)."""
    if t is None or call.batched(name):
        return t
    return t.expand(b, *t.shape).contiguous()


def _affine(call: Call, b: int, kw: dict[str, Any]) -> list[Any]:
    """weight and bias as [B, ...]."""
    return [_per_model_copy(call, kw.get(k), k, b) for k in _PARAMS]


def layer_norm_rule(call: Call) -> Rewrite:
    if not _batched_names(call, _PARAMS):
        return Rewrite(call.op)  # normalising trailing dims works for any leading dims

    def impl(**kw: Any) -> Any:
        b = _models(kw, ["input", *_PARAMS])
        x = _input(call, kw, b)
        weight, bias = _affine(call, b, kw)
        return layer_norm(x, kw["normalized_shape"], weight, bias, float(kw["eps"]))

    return Rewrite(named(impl, call.op, "fused"))


def group_norm_rule(call: Call) -> Rewrite:
    if not _batched_names(call, _PARAMS):
        return Rewrite(named(_per_sample(call.op, "input"), call.op))

    def impl(**kw: Any) -> Any:
        b = _models(kw, ["input", *_PARAMS])
        x = _input(call, kw, b)
        weight, bias = _affine(call, b, kw)
        return group_norm(x, int(kw["num_groups"]), weight, bias, float(kw["eps"]))

    return Rewrite(named(impl, call.op, "fused"))


def rms_norm(call: Call) -> Rewrite:
    """RMSNorm (`F.rms_norm`): one normalisation, then each model's scale."""
    if not call.batched("weight"):
        return Rewrite(call.op)

    def impl(**kw: Any) -> Any:
        b = int(kw["weight"].shape[0])
        x = _input(call, kw, b)
        return fused_rms_norm(x, list(kw["normalized_shape"]), kw["weight"], kw["eps"])

    return Rewrite(named(impl, call.op, "fused"))


def prelu(call: Call) -> Rewrite:
    """PReLU: each model's slopes along its input's channel dim (dim 1; a single slope
    applies everywhere)."""
    if not call.batched("weight"):
        return Rewrite(named(_per_sample(call.op, "self"), call.op))

    def impl(**kw: Any) -> Any:
        w = kw["weight"]
        b = int(w.shape[0])
        x = kw["self"] if call.batched("self") else expand_models(kw["self"], b)
        per_model = x.dim() - 1
        if w.shape[1] == 1 or per_model < 2:  # one slope, or a per-model vector of channels
            slope = w.view(b, *([1] * (per_model - 1)), -1)
        else:
            slope = w.view(b, 1, -1, *([1] * (per_model - 2)))
        return torch.where(x >= 0, x, slope * x)

    return Rewrite(named(impl, call.op, "fused"))


# --------------------------------------------------------------------------- attention


def attention(call: Call) -> Rewrite:
    """scaled_dot_product_attention: B joins the leading batch dim of q, k, v and mask.

    A mask shared by all models (a causal or padding mask built from shapes) is expanded
    to every model's batch entries; a per-model one (built from per-model attention
    masks) lines up with them as it is. torch's own kernel runs, on B times the batch.
    """
    names = ("query", "key", "value", "attn_mask")
    flags = [call.batched(k) for k in names]

    def impl(**kw: Any) -> Any:
        b = _models(kw, [k for k, f in zip(names, flags, strict=True) if f])
        q, k, v = (kw[n] if f else expand_models(kw[n], b)
                   for n, f in zip(names[:3], flags[:3], strict=True))  # fmt: skip
        mask = kw["attn_mask"]
        lead = q.dim() - 3  # batch dims in front of (heads, T, d), B included
        if mask is not None:
            if flags[3]:
                mask = align([mask, q], [True, True])[0]
            else:  # pad on the left to the per-model rank, then B
                mask = mask.view(*([1] * (q.dim() - mask.dim())), *mask.shape)
        if lead <= 1:  # [B, (heads,) T, d]: B is the batch already
            kw.update(query=q, key=k, value=v, attn_mask=mask)
            return _attend(**kw)
        if mask is not None:
            mask = mask.expand(*q.shape[:lead], *mask.shape[lead:]).flatten(0, lead - 1)
        kw.update(query=q.flatten(0, lead - 1), key=k.flatten(0, lead - 1),
                  value=v.flatten(0, lead - 1), attn_mask=mask)  # fmt: skip
        return _attend(**kw).unflatten(0, q.shape[:lead])

    return Rewrite(named(impl, call.op, "fused"))


def _native_attend(**kw: Any) -> torch.Tensor | None:
    """The attention on plait's native kernel, or None where it does not apply.

    At sweep sizes (heads of 8-16, sequences of 32-64) torch's attention with dropout is
    its math path, a chain of [B*N, heads, T, T] tensors, each one pass over memory:
    scores, mask, softmax, its fully-masked-row check, dropout, product. The kernel keeps
    one (sequence, head) block in registers through all of it: the forward of a causal
    [128, 2, 32, 16] attention with dropout 0.1 takes 1.2 ms against torch's 5.2-7.6 ms on
    one core (measured). A boolean mask becomes an additive one of 0 and -inf.
    """
    q, k, v, mask = kw["query"], kw["key"], kw["value"], kw["attn_mask"]
    if q.device.type != "cpu" or (k.shape[-3] != q.shape[-3] and not kw["enable_gqa"]):
        return None
    if mask is not None:
        if mask.dim() != 4:
            return None
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
    lib = native.attention_heads_kernels(q, k, v, mask)
    if lib is None:
        return None
    p = float(kw["dropout_p"])
    scale = kw["scale"] if kw["scale"] is not None else q.shape[-1] ** -0.5
    return native.attention_heads(
        q, k, v, mask=mask, causal=bool(kw["is_causal"]), dropout=[p] if p else None,
        scale=float(scale), lib=lib,
    )  # fmt: skip


def _attend(**kw: Any) -> torch.Tensor:
    """The native kernel where it applies (`_native_attend`), else torch's attention
    kernel; with dropout, its math path written out so that the probabilities take the
    fused dropout (`ops.dropout`) and its fast kernel.

    The written-out path computes what torch's CPU math path does: scores, the causal or
    given mask, a softmax that leaves fully masked rows at zero, dropout, the product.
    """
    native_out = _native_attend(**kw)
    if native_out is not None:
        return native_out
    p = float(kw["dropout_p"])
    if p == 0.0:
        out: torch.Tensor = aten.scaled_dot_product_attention.default(**kw)
        return out
    q, k, v, mask = kw["query"], kw["key"], kw["value"], kw["attn_mask"]
    if kw["enable_gqa"] and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
    scale = kw["scale"] if kw["scale"] is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    t, s = scores.shape[-2:]
    if kw["is_causal"]:
        causal = torch.ones(t, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else (
            scores + mask)  # fmt: skip
    probs = aten._safe_softmax.default(scores, -1)
    b = probs.shape[0]
    return torch.matmul(model_dropout(probs, [p] * b, training=True), v)


# -------------------------------------------------------------------------------- gelu


def gelu_rule(call: Call) -> Rewrite:
    """GELU, element-wise as every pointwise operator; the tanh form (GPT-2's, which
    `patterns.simplify` also finds written out) on the native kernel where it applies."""

    def impl(**kw: Any) -> Any:
        x, approximate = kw["self"], kw["approximate"]
        lib = native.gelu_kernels(x, approximate=approximate)
        if lib is not None:
            return native.gelu(x, lib=lib)
        return aten.gelu.default(x, approximate=approximate)

    return Rewrite(named(impl, call.op, "fused"))


# ------------------------------------------------------------------------------ rotary


def rotary_rule(call: Call) -> Rewrite:
    """`plait::rotary` (the rotary embedding `patterns.simplify` finds): the native kernel
    when cos and sin are shared by all models (built from positions), else the operator's
    torch definition on the aligned operands, as every pointwise operator."""
    fallback = pointwise(call).impl
    shared = not call.batched("cos") and not call.batched("sin")

    def impl(**kw: Any) -> Any:
        lib = native.rotary_kernels(kw["x"], kw["cos"], kw["sin"]) if shared else None
        if lib is not None:
            return native.rotary(kw["x"], kw["cos"], kw["sin"], lib=lib)
        return fallback(**kw)

    return Rewrite(named(impl, call.op, "fused"))


# ----------------------------------------------------------------------------- dropout


def dropout(call: Call) -> Rewrite:
    """Dropout: one draw over [B, ...]; each model at its own layer's probability."""
    recorded = float(call.args["p"])

    def impl(**kw: Any) -> Any:
        x = kw["input"]
        p = kw.pop("p_models", None)
        probs = [recorded] * int(x.shape[0]) if p is None else list(p)
        return model_dropout(x, probs, training=bool(kw["train"]))

    return Rewrite(named(impl, call.op, "fused"), settings={"p_models": (nn.Dropout, "p")})


# ---------------------------------------------------------------------------- spatial


def spatial(k: int | None) -> Rule:
    """Per-sample, per-channel ops over k spatial dims (pooling, padding, upsampling)."""

    def rule(call: Call) -> Rewrite:
        first = next(iter(call.args))
        if any(call.batched(n) for n in call.args if n != first):
            raise call.unsupported("per-model arguments beyond the input cannot be fused")
        op = _KERNELS.get(getattr(call.op, "overloadpacket", None), call.op)

        def impl(**kw: Any) -> Any:
            x = kw.pop(first)
            n = k if k is not None else x.dim() - 3
            return per_channel(lambda t: op(t, **kw), x, n)

        return Rewrite(named(impl, call.op, "per_channel"))

    return rule


def pad(call: Call) -> Rewrite:
    """Constant padding touches trailing dims only; other modes pad per channel."""
    if call.args.get("mode", "constant") == "constant":
        return Rewrite(call.op)
    return spatial(len(call.args["pad"]) // 2)(call)


# ------------------------------------------------------------------------------ losses

_NONE, _MEAN, _SUM = 0, 1, 2


def _per_model(loss: torch.Tensor, reduction: int) -> torch.Tensor:
    """[B, ...] unreduced losses -> [B] by the reduction asked for ("none" keeps them)."""
    if reduction == _NONE:
        return loss
    flat = loss.flatten(1)
    return flat.mean(1) if reduction == _MEAN else flat.sum(1)


def elementwise_loss(call: Call) -> Rewrite:
    """MSE, L1, smooth L1, Huber, BCE, KL...: unreduced, then reduced per model."""
    names = [n for n in call.args if isinstance(call.args[n], torch.fx.Node)]
    flags = [call.batched(n) for n in names]
    op = call.op

    def impl(**kw: Any) -> Any:
        reduction = int(kw["reduction"])
        for n, v in zip(names, align([kw[n] for n in names], flags), strict=True):
            kw[n] = v
        b = _models(kw, [n for n, f in zip(names, flags, strict=True) if f])
        _to_models(call, kw, names, b)
        kw["reduction"] = _NONE
        return _per_model(op(**kw), reduction)

    return Rewrite(named(impl, op, "per_model"))


def class_loss(call: Call) -> Rewrite:
    """cross_entropy_loss / nll_loss: inputs [B, N, C, ...] or [B, C] (one sample per
    model). "mean" divides each model's sum by its own count of targets that are not
    `ignore_index` (weighted by the class weights), as torch does for one model."""
    op = call.op
    flags = (call.batched("self"), call.batched("target"))
    if call.batched("weight"):
        raise call.unsupported("per-model class weights cannot be fused")

    def impl(**kw: Any) -> Any:
        x, target = kw["self"], kw["target"]
        b = int((x if flags[0] else target).shape[0])
        x = x if flags[0] else expand_models(x, b)
        target = target if flags[1] else expand_models(target, b)
        reduction = int(kw["reduction"])
        single = x.dim() == 2  # each model's input is one sample [C]
        kw.update(reduction=_NONE,
                  self=x if single else x.flatten(0, 1),
                  target=target if single else target.flatten(0, 1))  # fmt: skip
        loss = op(**kw)
        loss = loss if single else loss.unflatten(0, (b, x.shape[1]))
        if reduction == _NONE:
            return loss
        if reduction == _SUM or target.is_floating_point():
            return _per_model(loss.view(b, -1), reduction)
        # "mean" over class-index targets: over the targets that count, weighted
        count = (target != kw["ignore_index"]).to(loss.dtype)
        weight = kw.get("weight")
        if weight is not None:
            count = count * weight[target.clamp(min=0)]
        return loss.view(b, -1).sum(1) / count.view(b, -1).sum(1)

    return Rewrite(named(impl, op, "per_model"))


#: Ops run on plait's choice of torch kernel (same values, faster).
_KERNELS: dict[Any, Any] = {
    aten.max_pool2d: max_pool2d, aten.max_pool2d_with_indices: max_pool2d_with_indices,
}  # fmt: skip

_SPATIAL: dict[Any, int | None] = {
    aten.max_pool1d: 1, aten.max_pool2d: 2, aten.max_pool3d: 3,
    aten.max_pool2d_with_indices: 2, aten.max_pool3d_with_indices: 3,
    aten.avg_pool1d: 1, aten.avg_pool2d: 2, aten.avg_pool3d: 3,
    aten.adaptive_avg_pool1d: 1, aten.adaptive_avg_pool2d: 2, aten.adaptive_avg_pool3d: 3,
    aten._adaptive_avg_pool2d: 2, aten.adaptive_max_pool1d: 1, aten.adaptive_max_pool2d: 2,
    aten.upsample_nearest1d: 1, aten.upsample_nearest2d: 2, aten.upsample_bilinear2d: 2,
    aten.upsample_bicubic2d: 2, aten.upsample_linear1d: 1, aten.reflection_pad1d: 1,
    aten.reflection_pad2d: 2, aten.replication_pad1d: 1, aten.replication_pad2d: 2,
    aten.pixel_shuffle: 2, aten.pixel_unshuffle: 2, aten.channel_shuffle: 2,
}  # fmt: skip

LAYER_RULES: dict[Any, Rule] = {
    aten.linear: linear, aten.addmm: addmm, aten.embedding: embedding,
    aten.conv1d: convolution, aten.conv2d: convolution, aten.conv3d: convolution,
    aten.convolution: convolution, aten.batch_norm: batch_norm_rule,
    aten.layer_norm: layer_norm_rule, aten.group_norm: group_norm_rule,
    aten.rms_norm: rms_norm, aten.prelu: prelu, aten.scaled_dot_product_attention: attention,
    aten.dropout: dropout, aten.gelu: gelu_rule, native_ops.rotary: rotary_rule,
    aten.pad: pad, aten.constant_pad_nd: pad,
    aten.cross_entropy_loss: class_loss, aten.nll_loss: class_loss,
    aten.nll_loss_nd: class_loss, aten.nll_loss2d: class_loss,
    aten.mse_loss: elementwise_loss, aten.l1_loss: elementwise_loss,
    aten.smooth_l1_loss: elementwise_loss, aten.huber_loss: elementwise_loss,
    aten.binary_cross_entropy: elementwise_loss,
    aten.binary_cross_entropy_with_logits: elementwise_loss,
    aten.soft_margin_loss: elementwise_loss, aten.kl_div: elementwise_loss,
    **{op: spatial(k) for op, k in _SPATIAL.items()},
}  # fmt: skip
