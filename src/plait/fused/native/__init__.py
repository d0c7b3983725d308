"""Native CPU kernels for fused arrays: narrow attention, layer norm and RMSNorm, the
rotary embedding, GELU's tanh form, dropout, and Adam's step.

A fused array of sweep-sized Transformers hands torch thousands of tiny problems per
call: 16 models x 32 sequences x 2 heads of 16 x 16 attention blocks, or rows of 16 to
normalise. torch's CPU kernels pay a fixed cost per block or row there (batched matmuls
about 100 ns per block, layer norm about 25 ns per row, measured), which fusing cannot
amortise. These kernels hold one problem in registers and vectorise across it; the
fused layers call them when they apply and keep their torch path otherwise
(`PLAIT_NATIVE=0` or `set_enabled(False)` forces the torch path everywhere). Captured
models (`plait.fused.capture`) reach them too: their attention (`attention_heads`:
strided q, k, v, causal or masked, grouped-query, dropout inside), layer norm and RMSNorm,
rotary embedding and GELU run here.

`FusedAdam` uses the Adam kernel for the common sweep case (per-model learning rates,
everything else shared): it reads each gradient where autograd left it and updates each
parameter where it lives, one pass where torch's fused kernel, which takes one learning
rate, needs the gradients gathered into a flat buffer and the per-model update scattered
back.
"""

from __future__ import annotations

from plait.fused.native.build import enabled, set_enabled, unavailable_reason
from plait.fused.native.functions import (
    adam_kernels,
    adam_step,
    attention_heads,
    attention_heads_kernels,
    attention_kernels,
    dropout,
    dropout_kernels,
    gelu,
    gelu_kernels,
    layer_norm,
    layer_norm_kernels,
    packed_attention,
    rotary,
    rotary_kernels,
)

__all__ = [
    "adam_kernels",
    "adam_step",
    "attention_heads",
    "attention_heads_kernels",
    "attention_kernels",
    "dropout",
    "dropout_kernels",
    "enabled",
    "gelu",
    "gelu_kernels",
    "layer_norm",
    "layer_norm_kernels",
    "packed_attention",
    "rotary",
    "rotary_kernels",
    "set_enabled",
    "unavailable_reason",
]
