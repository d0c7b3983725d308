"""fp16 / bf16: all-reduce the bucket in half precision, half the bytes of S-SGD.

The bucket is divided by the world size *before* the cast, so the sum of half-precision
values cannot overflow where the average would not.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch._C._distributed_c10d import GradBucket

from plait.comm import all_reduce, wait, world_size
from plait.dp.compress.base import Compressor
from plait.trace import COMPRESS, span, tracer


class CastAllReduce(Compressor):
    """Cast to `wire_dtype`, all-reduce, cast back (an abstract base: see fp16, bf16)."""

    wire_dtype: ClassVar[torch.dtype]

    def __init__(self, *, group: Any = None) -> None:
        super().__init__(group=group)

    def payload_nbytes(self, name: str, param: torch.Tensor) -> float:
        return float(param.numel() * min(param.element_size(), self.wire_dtype.itemsize))

    def hook(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        with span("compress", COMPRESS, bucket=bucket.index()):
            wire = buf.div(world_size(self.group)).to(self.wire_dtype)
        fut = all_reduce(wire, group=self.group, name=f"allreduce b{bucket.index()}")

        def decompress(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            start = tracer.now_us()
            buf.copy_(wait(f))
            tracer.add("decompress", COMPRESS, start, tracer.now_us())
            return buf

        return fut.then(decompress)


class FP16(CastAllReduce):
    """IEEE half precision on the wire (range +-65504: the average is taken first)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16(CastAllReduce):
    """bfloat16 on the wire: fp32's range, 8 bits of mantissa."""

    name = "bf16"
    wire_dtype = torch.bfloat16
