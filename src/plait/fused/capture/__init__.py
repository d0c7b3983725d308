"""Fused arrays from the PyTorch 2 graph capture (`torch.export`), for models torch.fx
cannot trace: Hugging Face `transformers` models among them.

`CapturedArray` exports one model on the first call's inputs, rewrites the ATen graph
for B models (`rewrite`, with the batching rules of `rules` and the fused layers'
kernels of `layers`) and caches the result per model structure and input signature.
"""

from __future__ import annotations

from plait.fused.capture.array import CapturedArray, clear_cache, fingerprint, signature
from plait.fused.capture.rewrite import FusedGraph, Slot, SlotKind, rewrite

__all__ = [
    "CapturedArray",
    "FusedGraph",
    "Slot",
    "SlotKind",
    "clear_cache",
    "fingerprint",
    "rewrite",
    "signature",
]
