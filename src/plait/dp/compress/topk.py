"""Top-k sparsification with error feedback (Stich et al., 2018; Lin et al., DGC 2018).

Each worker adds its error to the bucket, sends the `ratio` largest entries by magnitude
(values and indices in one buffer) and keeps the rest as the next error. Index sets
differ between workers, so the buffers travel by all-gather and every worker scatters
all of them into its bucket: (world - 1) * 2 * ratio of S-SGD's all-gathered bytes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch._C._distributed_c10d import GradBucket

from plait.comm import Collective, all_gather, wait, world_size
from plait.dp.compress.base import check_positive
from plait.dp.compress.feedback import ErrorFeedbackCompressor
from plait.trace import COMPRESS, span, tracer


class TopK(ErrorFeedbackCompressor):
    """Top-k with error feedback, all-gathered; see the module docstring.

    Args:
        group: process group.
        ratio: fraction of each bucket's entries sent per step, in (0, 1].
    """

    name = "topk"
    collectives = frozenset({Collective.ALL_GATHER})

    def __init__(self, *, group: Any = None, ratio: float = 0.01) -> None:
        super().__init__(group=group)
        check_positive("ratio", ratio)
        if ratio > 1:
            raise ValueError(f"ratio must be <= 1, got {ratio}")
        self.ratio = float(ratio)

    def payload_nbytes(self, name: str, param: torch.Tensor) -> float:
        return param.numel() * self.ratio * (param.element_size() + 4)

    def hook(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        index = bucket.index()
        buf = bucket.buffer()
        p = world_size(self.group)
        err = self.errors.of(bucket, lambda ps: [self.param_name(t) for t in ps])
        k = max(1, math.ceil(self.ratio * buf.numel()))
        with span(f"compress b{index}", COMPRESS):
            err.add_(buf)  # corrected gradient
            idx = torch.topk(err.abs(), k, sorted=False).indices
            values = err[idx].float()
            err[idx] = 0  # what is sent leaves the error
            wire = torch.cat([values.view(torch.int32), idx.to(torch.int32)])
        fut = all_gather(wire, group=self.group, name=f"allgather b{index}")

        def decompress(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            start = tracer.now_us()
            gathered = wait(f)  # [p, 2k]: values (as int32 bits) then indices
            vals = gathered[:, :k].reshape(-1).clone().view(torch.float32).div_(p)
            buf.zero_()
            buf.index_add_(0, gathered[:, k:].reshape(-1).long(), vals.to(buf.dtype))
            tracer.add(f"decompress b{index}", COMPRESS, start, tracer.now_us())
            return buf

        return fut.then(decompress)
