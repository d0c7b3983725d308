"""Pseudo-gradient codecs: each averages like the exact mean within its precision, keeps
the ranks identical, and its error feedback loses nothing over rounds.

One spawned world-size-2 job runs every codec (spawning costs more than the codecs);
the quantiser runs in-process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.dp.local import Codec, LocalConfig, make_codec
from plait.dp.local.codecs import dequantize, quantize
from plait.testing import run_distributed

SHAPES = [(24, 16), (16,), (8, 4, 3, 3), (5,)]  # matrices, vectors, a conv kernel
ROUNDS = 5
CODECS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "int8": {"block": 32},
    "int4": {"block": 32},
    "topk": {"ratio": 0.25},
    "lowrank": {"rank": 2},
    "lowrank-full": {"compression": "lowrank", "rank": 16},
}


def _inputs(rank: int, rnd: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rnd + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _residual(codec: Any) -> torch.Tensor:
    """This rank's total residual as one flat vector over the fragment's values."""
    n = sum(torch.Size(s).numel() for s in SHAPES)
    if codec.codec is Codec.LOWRANK:
        store = codec.store
        return torch.cat(
            [
                store.params[f"p{i}"].error.reshape(-1)
                if f"p{i}" in store.params
                else torch.zeros(torch.Size(s).numel())
                for i, s in enumerate(SHAPES)
            ]
        )
    err = codec.errors.get("f")
    return torch.zeros(n) if err is None else err[:n].clone()


def _job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = [f"p{i}" for i in range(len(SHAPES))]
    for label, options in CODECS.items():
        opts = {"compression": label, **options} if "compression" not in options else options
        codec = make_codec(LocalConfig(**opts))
        outs, ins = [], []
        for rnd in range(ROUNDS):
            xs = _inputs(rank, rnd)
            ins.append(torch.cat([x.reshape(-1) for x in xs]))
            avg = codec.average("f", names, [x.clone() for x in xs], group=None)
            assert [tuple(a.shape) for a in avg] == [tuple(x.shape) for x in xs]
            outs.append(torch.cat([a.reshape(-1) for a in avg]))
        share = codec.errors.get("f/share")
        out[label] = {
            "outs": torch.stack(outs),
            "ins": torch.stack(ins),
            "residual": _residual(codec),
            "share": None if share is None else share.clone(),
        }
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_job, world_size=2, timeout_s=120)


#: the first round's error against the exact mean, relative to its largest value: what
#: each wire format can hold (fp16: 11 bits of mantissa; bf16: 8; int8 on blocks of 32:
#: half a step of absmax/127, on both the sent values and the re-quantised share; int4 the
#: same at absmax/7; top-k at 25% drops most values; rank-2 factors of these matrices and
#: ACP-SGD's first basis (a random one) capture a fraction of them)
FIRST_ROUND_TOL = {
    "none": 1e-6,
    "fp16": 2e-3,
    "bf16": 1e-2,
    "int8": 2e-2,
    "int4": 0.3,
    "topk": 1.0,
    "lowrank": 1.0,
    "lowrank-full": 1e-5,
}


@pytest.mark.parametrize("label", sorted(CODECS))
def test_average_is_the_mean_within_the_wire_precision(
    label: str, ranks: list[dict[str, Any]]
) -> None:
    r0, r1 = ranks[0][label], ranks[1][label]
    assert torch.equal(r0["outs"], r1["outs"]), "the ranks must hold the same average"
    exact = (r0["ins"][0] + r1["ins"][0]) / 2
    err = (r0["outs"][0] - exact).abs().max() / exact.abs().max()
    assert err <= FIRST_ROUND_TOL[label], (label, float(err))
    if label in ("topk", "lowrank"):  # compressed for real: not the exact mean
        assert err > 1e-3, (label, float(err))


@pytest.mark.parametrize("label", sorted(CODECS))
def test_error_feedback_loses_nothing_over_rounds(label: str, ranks: list[dict[str, Any]]) -> None:
    """sum of averages + the ranks' mean residual (+ the owners' share residuals) equals
    the mean of the inputs' sum: every dropped value is still on its way (float32 sums of
    five rounds: 1e-4). fp16/bf16 add the ranks' values on the wire in half precision, and
    that sum's rounding (half an ulp of the sum per round: 2^-11, 2^-8 of its size) is the
    one loss no worker sees."""
    r0, r1 = ranks[0][label], ranks[1][label]
    sent = r0["outs"].sum(0)
    total_in = (r0["ins"].sum(0) + r1["ins"].sum(0)) / 2
    kept = (r0["residual"] + r1["residual"]) / 2
    if r0["share"] is not None:  # int8/int4: each rank owns a share of the average
        owners = torch.cat([r0["share"], r1["share"]])[: sent.numel()]
        kept = kept + owners
    ulp = {"fp16": 2.0**-10, "bf16": 2.0**-7}.get(label, 0.0)
    atol = 1e-4 + ROUNDS * ulp * float(r0["outs"].abs().max())
    torch.testing.assert_close(sent + kept, total_in, atol=atol, rtol=0)


@pytest.mark.parametrize(("bits", "step"), [(8, 1 / 127), (4, 1 / 7)])
def test_quantiser_round_trip_is_within_half_a_step(bits: int, step: float) -> None:
    x = torch.randn(8 * 64)
    x[64:128] = 0  # an all-zero block keeps scale 1 and decodes to zeros
    codes, scale = quantize(x, bits, 64)
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel() * bits // 8
    y = dequantize(codes, scale, bits, 64)
    amax = x.view(-1, 64).abs().amax(1, keepdim=True)
    assert ((y - x).view(-1, 64).abs() <= amax * step / 2 + 1e-7).all()
    assert torch.equal(y[64:128], torch.zeros(64))


def test_int4_needs_an_even_block() -> None:
    with pytest.raises(ValueError, match="block must be even"):
        make_codec(LocalConfig(compression="int4", block=33))  # type: ignore[arg-type]
