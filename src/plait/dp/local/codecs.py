"""Pseudo-gradient codecs: how one fragment's pseudo-gradients are averaged over workers.

A codec takes this worker's pseudo-gradients of one fragment (fp32, parameters before the
round minus after) and returns the average over the group, exactly (``none``) or
approximately (the rest), with error feedback: what compression drops stays on the worker
and is added to the next round's pseudo-gradient, which keeps biased compressors
converging. Pseudo-gradients of consecutive rounds point the same way far more than
single-step gradients do, so they tolerate coarse compression: Streaming DiLoCo sends
them in 4 bits, SparseLoCo as top-k.

Codecs run where the round's exchange runs (the caller's thread, or the communication
thread of an overlapped exchange) and talk only through `plait.comm`, so every byte is
counted, traced and bounded by the group's timeout.

Wire formats (p workers, n values):
- ``none``: one fp32 all-reduce, 2(p-1)/p * 4n bytes sent per worker.
- ``fp16``/``bf16``: one all-reduce in half precision (the value is divided by p first,
  so the sum cannot overflow where the average would not): half of ``none``.
- ``int8``/``int4``: each worker quantises its values per block of `block` (one fp32
  absmax scale per block), an all-to-all hands every worker its 1/p share from everyone,
  it averages and re-quantises that share (keeping its own rounding error for the next
  round), and an all-gather hands the shares back: 2(p-1)/p * n * (bits/8 + 4/block)
  bytes, 7.5x less than ``none`` at 4 bits and blocks of 128. A sum of quantised values
  is not quantised, so they cannot ride a plain all-reduce.
- ``topk``: the `ratio` largest corrected values and their indices, all-gathered:
  (p-1) * 8 * ratio * n bytes.
- ``lowrank``: ACP-SGD's alternating factor per matrix (P = M Q on one round, Q = M^T P on
  the next, on the last averaged basis), vectors uncompressed, in one all-reduce.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from plait.comm import Collective, all_gather, all_reduce, all_to_all, wait, world_size
from plait.dp.compress.acpsgd import decode as acp_decode
from plait.dp.compress.acpsgd import encode as acp_encode
from plait.dp.compress.lowrank import LowRankStore, Phase, RankPolicy
from plait.dp.compress.topk import scatter_topk_, select_topk_
from plait.dp.local.config import Codec, LocalConfig

Group = Any


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One fresh fp32 vector holding `tensors` end to end."""
    return torch.cat([t.reshape(-1).float() for t in tensors])


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped like `like`."""
    parts = flat.split([t.numel() for t in like])
    return [p.view(t.shape) for p, t in zip(parts, like, strict=True)]


class PseudoGradientCodec(ABC):
    """Averages a fragment's pseudo-gradients over a group; keeps its error feedback.

    Args:
        error_feedback: carry what compression dropped into the next round.
    """

    codec: ClassVar[Codec]
    #: the collective kinds `average` issues
    collectives: ClassVar[frozenset[Collective]] = frozenset({Collective.ALL_REDUCE})

    def __init__(self, *, error_feedback: bool = True) -> None:
        self.error_feedback = error_feedback
        #: per fragment key, the flat residual of the last round (a codec's own layout)
        self.errors: dict[str, torch.Tensor] = {}

    @abstractmethod
    def average(
        self, key: str, names: Sequence[str], deltas: list[torch.Tensor], *, group: Group
    ) -> list[torch.Tensor]:
        """The average over `group` of every worker's `deltas` (this worker's pseudo-
        gradients of fragment `key`, parameters `names`); `deltas` belong to the call and
        may be overwritten. Every rank must call it for the same fragments in the same
        order (it issues collectives)."""

    def payload_nbytes(self, numel: int, world: int) -> float:
        """Bytes one worker hands to its collectives per round for `numel` values."""
        return 4.0 * numel

    def _residual(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The stored residual of `key`, zeros the first time."""
        err = self.errors.get(key)
        if err is None or err.shape != like.shape:
            if err is not None:
                raise ValueError(
                    f"error feedback of {key!r} holds {err.numel()} values, the fragment "
                    f"{like.numel()} (checkpoint from another model or fragment count?)"
                )
            err = torch.zeros_like(like)
            self.errors[key] = err
        return err

    def state_dict(self) -> dict[str, Any]:
        return {"errors": {k: v.clone() for k, v in self.errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "errors" not in state:
            raise ValueError(f"{self.codec} codec state lacks 'errors'")
        self.errors = {str(k): torch.as_tensor(v) for k, v in state["errors"].items()}


class Dense(PseudoGradientCodec):
    """fp32 all-reduce: the exact average (DiLoCo as published)."""

    codec = Codec.NONE

    def average(
        self, key: str, names: Sequence[str], deltas: list[torch.Tensor], *, group: Group
    ) -> list[torch.Tensor]:
        flat = flatten(deltas).div_(world_size(group))
        wait(all_reduce(flat, group=group, name=f"outer {key}"))
        return unflatten(flat, deltas)


class Cast(PseudoGradientCodec):
    """All-reduce in fp16 or bf16, the rounding error fed back."""

    DTYPES: ClassVar[dict[Codec, torch.dtype]] = {
        Codec.FP16: torch.float16,
        Codec.BF16: torch.bfloat16,
    }

    def __init__(self, codec: Codec, *, error_feedback: bool = True) -> None:
        super().__init__(error_feedback=error_feedback)
        self.codec = codec  # type: ignore[misc]  # an instance's own kind
        self.dtype = self.DTYPES[codec]

    def payload_nbytes(self, numel: int, world: int) -> float:
        return float(numel * self.dtype.itemsize)

    def average(
        self, key: str, names: Sequence[str], deltas: list[torch.Tensor], *, group: Group
    ) -> list[torch.Tensor]:
        p = world_size(group)
        x = flatten(deltas)
        if self.error_feedback:
            x.add_(self._residual(key, x))
        wire = x.div(p).to(self.dtype)
        if self.error_feedback:
            self.errors[key] = x.sub_(wire.float().mul_(p))
        wait(all_reduce(wire, group=group, name=f"outer {key}"))
        return unflatten(wire.float(), deltas)


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantisation of flat `x` (a whole number of blocks) to `bits`.

    Returns:
        The codes as bytes (int8: one per value; int4: two per byte, high nibble first)
        and one fp32 scale per block (absmax / (2^(bits-1) - 1); 1 for an all-zero block).
    """
    qmax = 2 ** (bits - 1) - 1
    xb = x.view(-1, block)
    scale = xb.abs().amax(dim=1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xb / scale.unsqueeze(1)).clamp_(-qmax, qmax).to(torch.int8)
    if bits == 8:
        return q.view(torch.uint8).reshape(-1), scale
    u = (q + 8).to(torch.uint8).view(-1, 2)  # 1..15: a nibble each
    return (u[:, 0] << 4) | u[:, 1], scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """The fp32 values `quantize` encoded."""
    if bits == 8:
        q = codes.view(torch.int8).float()
    else:
        q = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1).float().sub_(8)
    return q.view(-1, block).mul_(scale.unsqueeze(1)).reshape(-1)


class Quantized(PseudoGradientCodec):
    """int8 / int4 per-block quantisation, averaged by all-to-all then all-gather."""

    BITS: ClassVar[dict[Codec, int]] = {Codec.INT8: 8, Codec.INT4: 4}
    collectives = frozenset({Collective.ALL_TO_ALL, Collective.ALL_GATHER})

    def __init__(self, codec: Codec, *, block: int = 128, error_feedback: bool = True) -> None:
        super().__init__(error_feedback=error_feedback)
        self.codec = codec  # type: ignore[misc]
        self.bits = self.BITS[codec]
        if self.bits == 4 and block % 2:
            raise ValueError(f"int4 packs two values per byte: block must be even, got {block}")
        self.block = block

    def payload_nbytes(self, numel: int, world: int) -> float:
        return 2.0 * numel * (self.bits / 8 + 4 / self.block)

    def _pack(self, x: torch.Tensor, parts: int) -> torch.Tensor:
        """`x` quantised, as `parts` rows of bytes: row j holds part j's codes and scales."""
        codes, scale = quantize(x, self.bits, self.block)
        rows = torch.cat([codes.view(parts, -1), scale.view(parts, -1).view(torch.uint8)], 1)
        return rows

    def _unpack(self, rows: torch.Tensor, values_per_row: int) -> torch.Tensor:
        """The values of byte rows `_pack` made, [rows, values_per_row]."""
        nbytes = values_per_row * self.bits // 8
        codes = rows[:, :nbytes].reshape(-1)
        scale = rows[:, nbytes:].reshape(-1).clone().view(torch.float32)
        return dequantize(codes, scale, self.bits, self.block).view(rows.shape[0], -1)

    def average(
        self, key: str, names: Sequence[str], deltas: list[torch.Tensor], *, group: Group
    ) -> list[torch.Tensor]:
        p = world_size(group)
        flat = flatten(deltas)
        n = flat.numel()
        share = math.ceil(n / (p * self.block)) * self.block  # values each worker averages
        x = torch.zeros(share * p)
        x[:n] = flat
        if self.error_feedback:
            x.add_(self._residual(key, x))
        rows = self._pack(x, p)
        if self.error_feedback:
            self.errors[key] = x.sub_(self._unpack(rows, share).view(-1))
        got = wait(all_to_all(rows, group=group, name=f"outer {key} scatter"))
        mine = self._unpack(got.view(p, -1), share).mean(dim=0)
        owner = f"{key}/share"
        if self.error_feedback:
            mine.add_(self._residual(owner, mine))
        row = self._pack(mine, 1)
        if self.error_feedback:
            self.errors[owner] = mine.sub_(self._unpack(row, share).view(-1))
        gathered = wait(all_gather(row.view(-1), group=group, name=f"outer {key} gather"))
        out = self._unpack(gathered.view(p, -1), share).view(-1)[:n]
        return unflatten(out.contiguous(), deltas)


class TopK(PseudoGradientCodec):
    """The largest `ratio` of the corrected values, all-gathered (SparseLoCo's selection)."""

    codec = Codec.TOPK
    collectives = frozenset({Collective.ALL_GATHER})

    def __init__(self, *, ratio: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(error_feedback=error_feedback)
        self.ratio = ratio

    def payload_nbytes(self, numel: int, world: int) -> float:
        return 8.0 * math.ceil(self.ratio * numel)

    def average(
        self, key: str, names: Sequence[str], deltas: list[torch.Tensor], *, group: Group
    ) -> list[torch.Tensor]:
        x = flatten(deltas)
        if self.error_feedback:
            x.add_(self._residual(key, x))
        k = max(1, math.ceil(self.ratio * x.numel()))
        wire = select_topk_(x, k)  # x keeps what was not sent
        if self.error_feedback:
            self.errors[key] = x
        gathered = wait(all_gather(wire, group=group, name=f"outer {key}"))
        return unflatten(scatter_topk_(torch.empty_like(x), gathered, k), deltas)


class LowRank(PseudoGradientCodec):
    """ACP-SGD's alternating low-rank factors, one all-reduce per round (`plait.dp.compress.
    acpsgd`): the basis is the last round's averaged factor, identical on every rank."""

    codec = Codec.LOWRANK

    def __init__(self, *, rank: int = 16, error_feedback: bool = True, seed: int = 0) -> None:
        super().__init__(error_feedback=error_feedback)
        self.store = LowRankStore(policy=RankPolicy(rank=rank), seed=seed)
        self.rounds: dict[str, int] = {}

    def payload_nbytes(self, numel: int, world: int) -> float:
        return 4.0 * numel  # an upper bound: the factors' size depends on the shapes

    def average(
        self, key: str, names: Sequence[str], deltas: list[torch.Tensor], *, group: Group
    ) -> list[torch.Tensor]:
        p = world_size(group)
        plan = self.store.plan((zlib.crc32(key.encode()),), lambda: list(names), deltas)
        rounds = self.rounds.get(key, 0)
        self.rounds[key] = rounds + 1
        phase = Phase.P if rounds % 2 == 0 else Phase.Q
        wire = plan.wire_buffer(phase.value)
        sends = acp_encode(plan, deltas, phase, wire)
        wire.div_(p)
        wait(all_reduce(wire, group=group, name=f"outer {key}"))
        acp_decode(plan, deltas, phase, sends, wire)
        if not self.error_feedback:
            for g in plan.groups:
                g.error.zero_()
        return deltas

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": dict(self.rounds), "lowrank": self.store.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"rounds", "lowrank"} - set(state)
        if missing:
            raise ValueError(f"lowrank codec state lacks {sorted(missing)}")
        self.rounds = {str(k): int(v) for k, v in state["rounds"].items()}
        self.store.load_state_dict(state["lowrank"])


def codec_class(config: LocalConfig) -> type[PseudoGradientCodec]:
    """The codec class `config.compression` names (its collectives, without building it)."""
    c = config.compression
    if c is Codec.NONE:
        return Dense
    if c in Cast.DTYPES:
        return Cast
    if c in Quantized.BITS:
        return Quantized
    return TopK if c is Codec.TOPK else LowRank


def make_codec(config: LocalConfig) -> PseudoGradientCodec:
    """The codec `config.compression` names, with its options."""
    c, ef = config.compression, config.error_feedback
    if c is Codec.NONE:
        return Dense(error_feedback=ef)
    if c in Cast.DTYPES:
        return Cast(c, error_feedback=ef)
    if c in Quantized.BITS:
        return Quantized(c, block=config.block, error_feedback=ef)
    if c is Codec.TOPK:
        return TopK(ratio=config.ratio, error_feedback=ef)
    assert c is Codec.LOWRANK, c
    return LowRank(rank=config.rank, error_feedback=ef)
