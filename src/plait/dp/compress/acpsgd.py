"""ACP-SGD: alternating low-rank compression with ONE all-reduce per bucket and step.

Power-SGD needs P = MQ all-reduced before it can compute Q = M^T P, so every bucket pays
two dependent all-reduces and cannot be fused or overlapped like plain S-SGD. ACP-SGD
(Zhang et al., ICDCS'23) alternates instead. With M the local gradient plus the error
left over from earlier steps:

- P-steps use the last all-reduced Q, orthonormalised, as the basis: send P = M Q, keep
  the error M - P Q^T, and the averaged gradient is avg(P) Q^T;
- Q-steps mirror this with the last all-reduced P: send Q = M^T P.

One matrix product, one small orthonormalisation and one all-reduce per step, issued
straight from the DDP hook, so compressed buckets overlap backward exactly as S-SGD's do.
Since the basis is identical on every rank, compression is linear in M: avg(P) Q^T is
the average of the local approximations, and the step depends on the workers' corrected
gradients only through their average. So each worker may keep M - avg(P) Q^T as its
error instead of M - P Q^T: the same average, hence the same training, but an
element-wise subtraction instead of a third skinny matrix product per step. Vectors
(biases, norms) and matrices that would barely shrink travel uncompressed in the same
buffer.

Starting from random factors, the first step captures only about r/m of each gradient
and the rest piles up as error; dense warm-up steps therefore also run a power iteration
on the (identical everywhere) averaged gradient, so compression starts from a basis that
fits it. Two warm-up steps are the default (PyTorch's Power-SGD hook needs as many): on
the GPT under AdamW, ACP-SGD without them sends gradients 95-200% off in its first three
steps, which an adaptive optimizer's moments remember; it then took 55 steps to the
held-out target where two warm-up steps took 45 (rank 16, seed 0; S-SGD 45), and 50
where they took 35 (rank 32, seed 1): benchmarks/dp/acpsgd-steps, `plait.bench.
lowrank_steps`, which emulates the workers in one process with this module's own math.

The one lasting difference from Power-SGD is the basis: Power-SGD projects a gradient on
a basis computed from that same gradient (P = M Q, then Q = M^T P), ACP-SGD on the basis
the previous step averaged. On the GPT that leaves 54% of the averaged gradient's norm to
the error feedback at rank 16, where Power-SGD leaves 7-13%. ACP-SGD sends half of
Power-SGD's bytes at the same rank, so rank 2r costs what Power-SGD's rank r costs: at
rank 32 its error falls to 40-42%, and after 70 steps its held-out loss was 0.002 and
0.06 above Power-SGD's at rank 16 (seeds 0 and 1), where rank 16 was 0.05 and 0.12 above.

What this implementation guarantees beyond the paper's code: the initial factors come
from a seed (no replica drift), the P/Q parity is counted by the compressor per
communicating step (skipped optimizer steps and `no_sync` accumulation cannot break it),
fp16/bf16 gradients work, and the state checkpoints per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._C._distributed_c10d import GradBucket

from plait.comm import all_reduce, wait, world_size
from plait.dp.compress.lowrank import (
    BucketPlan,
    LowRankCompressor,
    Phase,
    orthonormalize_rows_,
    write_product_,
)
from plait.trace import COMPRESS, span, tracer


class ACPSGD(LowRankCompressor):
    """ACP-SGD; see the module docstring and `LowRankCompressor` for the options (here
    `warmup` defaults to 2 dense steps: see the module docstring)."""

    name = "acpsgd"
    default_warmup = 2

    def phase_of(self, step: int) -> Phase:
        if step < self.warmup:
            return Phase.DENSE
        return Phase.P if (step - self.warmup) % 2 == 0 else Phase.Q

    def factor_nbytes(self, n: int, m: int, r: int) -> float:
        return (n + m) * r / 2.0  # P (n x r) and Q (m x r) on alternate steps

    def hook(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        phase = self.begin(bucket)
        index = bucket.index()
        p = world_size(self.group)
        grads = bucket.gradients()
        plan = self.plan(bucket, grads)
        if phase is Phase.DENSE:
            buf = bucket.buffer()
            buf.div_(p)
            fut = all_reduce(buf, group=self.group, name=f"allreduce b{index}")
            return fut.then(lambda f: self._warm_factors(plan, grads, wait(f)))
        wire = plan.wire_buffer(phase.value)
        with span(f"compress b{index}", COMPRESS, phase=phase.value):
            sends = encode(plan, grads, phase, wire)
            wire.div_(p)
        fut = all_reduce(wire, group=self.group, name=f"allreduce b{index}")

        def decompress(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            wait(f)  # re-raise a failed all-reduce
            start = tracer.now_us()
            decode(plan, grads, phase, sends, wire)
            tracer.add(f"decompress b{index}", COMPRESS, start, tracer.now_us())
            return bucket.buffer()

        return fut.then(decompress)

    @staticmethod
    def _warm_factors(
        plan: BucketPlan, grads: list[torch.Tensor], buf: torch.Tensor
    ) -> torch.Tensor:
        """During dense warm-up, track the averaged gradient's top subspace locally.

        Every rank holds the same averaged gradient G after a dense step, so one power
        iteration on it (P = orth(G Q), Q = orth(G^T P)) keeps the factors identical
        everywhere without sending anything. Compression then starts from a basis that
        already captures the gradient, instead of a random one that captures ~r/m of it
        and leaves the rest to pile up in the error buffers.
        """
        for g in plan.groups:
            mats = g.matrices(grads)
            for j, mat in enumerate(mats):
                torch.mm(g.q[j], mat.t(), out=g.p[j])
            orthonormalize_rows_(g.p)
            for j, mat in enumerate(mats):
                torch.mm(g.p[j], mat, out=g.q[j])
            orthonormalize_rows_(g.q)
        return buf


def encode(
    plan: BucketPlan, grads: Sequence[torch.Tensor], phase: Phase, wire: torch.Tensor
) -> list[torch.Tensor]:
    """One ACP-SGD compression into `wire`: per matrix group, error := M + error and the
    factor of `phase` (P = M Q or Q = M^T P on the last averaged basis), then the
    uncompressed tensors. Returns the groups' factor views of `wire`."""
    sends = plan.factor_views(wire, phase.value)
    for g, send in zip(plan.groups, sends, strict=True):
        torch._foreach_add_(g.errors, g.matrices(grads))  # error := M + error
        if phase is Phase.P:
            torch.bmm(g.q, g.error.transpose(1, 2), out=send)  # P^T = Q^T M^T
        else:
            torch.bmm(g.p, g.error, out=send)  # Q^T = P^T M
    plan.pack_dense(grads, wire)
    return sends


def decode(
    plan: BucketPlan,
    grads: Sequence[torch.Tensor],
    phase: Phase,
    sends: Sequence[torch.Tensor],
    wire: torch.Tensor,
) -> None:
    """Write the averaged approximation of every matrix (and the averaged uncompressed
    tensors) from the all-reduced `wire` into `grads`; keep error := M - approximation and
    the averaged factor, orthonormalised, as the next step's basis."""
    for g, avg in zip(plan.groups, sends, strict=True):
        mats = g.matrices(grads)
        if phase is Phase.P:
            for j, mat in enumerate(mats):
                write_product_(mat, avg[j].t(), g.q[j])
            orthonormalize_rows_(g.p.copy_(avg))  # next step's basis
        else:
            for j, mat in enumerate(mats):
                write_product_(mat, g.p[j].t(), avg[j])
            orthonormalize_rows_(g.q.copy_(avg))
        torch._foreach_sub_(g.errors, mats)  # error := M - averaged approximation
    plan.unpack_dense(grads, wire)
