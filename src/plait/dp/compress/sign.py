"""EF-SignSGD (Karimireddy et al., 2019): one bit per gradient entry, error feedback.

Each worker adds its error to the gradient, sends the signs packed eight to a byte plus
one scale per tensor (its mean absolute value, so the compressed tensor keeps the L1
norm), and keeps what the scaled signs missed as the next error. Signs do not sum into
signs, so the buffers travel by all-gather and every worker averages the decoded copies:
(world - 1) / 32 of S-SGD's bytes per worker with fp32 gradients.
"""

from __future__ import annotations

import torch
from torch._C._distributed_c10d import GradBucket

from plait.comm import Collective, all_gather, wait, world_size
from plait.dp.compress.feedback import ErrorFeedbackCompressor
from plait.trace import COMPRESS, span, tracer

#: Bit weights of one byte, most significant first (numpy's ``packbits`` order).
_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def packbits(mask: torch.Tensor) -> torch.Tensor:
    """`mask` (bool, 1-d) as bytes, eight entries each, most significant bit first, on its
    own device (numpy's ``packbits`` works on host memory only)."""
    pad = (-mask.numel()) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    return (m * weights).sum(dim=1, dtype=torch.uint8)


def unpackbits(data: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` bits of `data` (uint8, 1-d), most significant first, as 0/1 uint8."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=data.device)
    return ((data.unsqueeze(-1) >> shifts) & 1).view(-1)[:count]


class SignSGD(ErrorFeedbackCompressor):
    """Scaled-sign compression with error feedback, all-gathered; see the module docstring."""

    name = "signsgd"
    collectives = frozenset({Collective.ALL_GATHER})

    def payload_nbytes(self, name: str, param: torch.Tensor) -> float:
        return param.numel() / 8.0 + 4.0

    def hook(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        index = bucket.index()
        buf = bucket.buffer()
        p = world_size(self.group)
        err = self.errors.of(bucket, lambda ps: [self.param_name(t) for t in ps])
        sizes = [g.numel() for g in bucket.gradients()]
        n = buf.numel()
        with span(f"compress b{index}", COMPRESS):
            err.add_(buf)  # corrected gradient
            parts = list(err.split(sizes))
            scales = torch.stack(torch._foreach_norm(parts, 1)).float() / torch.tensor(
                sizes, dtype=torch.float32, device=err.device
            )
            positive = err >= 0
            bits = packbits(positive)
            # error := corrected - scale * sign
            signs = positive.to(err.dtype).mul_(2).sub_(1)
            torch._foreach_mul_(list(signs.split(sizes)), scales.tolist())
            err.sub_(signs)
            wire = torch.cat([scales.view(torch.uint8), bits])
        fut = all_gather(wire, group=self.group, name=f"allgather b{index}")

        def decompress(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            start = tracer.now_us()
            gathered = wait(f)  # [p, 4 * tensors + bits]
            head = 4 * len(sizes)
            raw = gathered[:, :head].reshape(-1).clone()  # a fresh, aligned copy to reinterpret
            all_scales = raw.view(torch.float32).view(p, len(sizes)) / p  # [p, tensors]
            buf.zero_()
            for i in range(p):  # one worker at a time: no [p, n] decoded copy
                decoded = unpackbits(gathered[i, head:], n).to(buf.dtype).mul_(2).sub_(1)
                torch._foreach_mul_(list(decoded.split(sizes)), all_scales[i].tolist())
                buf.add_(decoded)
            tracer.add(f"decompress b{index}", COMPRESS, start, tracer.now_us())
            return buf

        return fut.then(decompress)
