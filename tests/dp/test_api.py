"""`plait.data_parallel`: bad input, bucket planning, strategies."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import plait
from plait.comm.fusion import ThresholdPlanner, ddp_bucket_caps_mb
from plait.dp import comm_hook, compressor_names, make_compressor
from plait.dp.compress import ACPSGD
from plait.testing import run_distributed
from plait.train.strategy import available_strategies, make_strategy

NAMES = ["acpsgd", "bf16", "fp16", "powersgd", "signsgd", "ssgd", "topk", "torch-powersgd"]


def test_every_compressor_is_a_strategy() -> None:
    assert set(NAMES) <= set(compressor_names())
    assert set(NAMES) <= set(available_strategies())
    s = make_strategy("acpsgd:rank=4,warmup=10,layer_ranks=fc*:8;head*:0")
    assert s.describe() == "acpsgd:layer_ranks=fc*:8;head*:0,rank=4,warmup=10"


def _bad_inputs(rank: int, world: int) -> list[str]:
    errors = []
    cases = [
        (lambda: plait.data_parallel(nn.Linear(4, 4), "nope"), "unknown compressor 'nope'"),
        (lambda: plait.data_parallel(nn.Linear(4, 4), "acpsgd", rank=0), "rank must be > 0"),
        (lambda: plait.data_parallel(nn.Linear(4, 4), "powersgd", rank=-1), "rank must be > 0"),
        (
            lambda: plait.data_parallel(nn.Linear(4, 4), "acpsgd", bogus=1),
            "no option 'bogus' (accepted: rank",
        ),
        (lambda: plait.data_parallel(nn.ReLU(), "acpsgd"), "no trainable parameters"),
        (lambda: plait.data_parallel("model", "acpsgd"), "expects an nn.Module"),  # type: ignore[arg-type]
        (
            lambda: plait.data_parallel(nn.Embedding(10, 4, sparse=True), "acpsgd"),
            "needs dense gradients",
        ),
    ]
    for make, message in cases:
        try:
            make()
        except ValueError as exc:
            if message not in str(exc):
                errors.append(f"{message!r} not in {exc}")
        else:
            errors.append(f"no ValueError for {message!r}")
    return errors


def test_bad_input_raises_value_error() -> None:
    assert run_distributed(_bad_inputs, world_size=1) == [[]]
    with pytest.raises(ValueError, match="initialised process group"):
        plait.data_parallel(nn.Linear(4, 4), "acpsgd")


def test_compressed_buckets_match_ssgd_count() -> None:
    """Planning on wire bytes with the threshold scaled by the ratio keeps S-SGD's bucket
    count; planning uncompressed sizes on the scaled threshold would split far more."""
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    comp = ACPSGD(rank=4)
    named = list(reversed([(n, p) for n, p in model.named_parameters()]))
    sizes = [p.numel() * 4 for _, p in named]
    wire = [comp.payload_nbytes(n, p) for n, p in named]
    planner = ThresholdPlanner(threshold_bytes=2 * 2**20)
    dense_caps = ddp_bucket_caps_mb(planner, sizes)
    scaled = planner.scaled(comp.compression_ratio(model))
    acp_caps = ddp_bucket_caps_mb(scaled, sizes, wire_sizes=wire)
    assert len(acp_caps) == len(dense_caps) == 4
    assert sum(acp_caps) == pytest.approx(sum(sizes) / 2**20)
    assert len(ddp_bucket_caps_mb(scaled, sizes)) == 8  # one bucket per layer


def test_spec_text_and_comm_hook_need_no_process_group() -> None:
    state, hook = comm_hook("acpsgd:rank=4,warmup=2")
    assert isinstance(state, ACPSGD)
    assert hook is ACPSGD.hook
    assert make_compressor("topk", ratio=0.5).name == "topk"
    with pytest.raises(
        ValueError, match=r"compressor 'acpsgd' has no option 'rnak' \(accepted: rank"
    ):
        comm_hook("acpsgd:rnak=4")
    with pytest.raises(ValueError, match=r"\['rank'\] given both"):
        make_compressor("acpsgd:rank=4", rank=2)
    with pytest.raises(ValueError, match="unknown compressor 'nope'"):
        comm_hook("nope:rank=4")


def _comm_hook_on_bare_ddp(rank: int, world: int) -> list[torch.Tensor]:
    """A DDP built by hand (as a framework would) with plait's hook registered on it."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(8, 8))
    ddp.register_comm_hook(*comm_hook("topk:ratio=0.1"))
    ddp(torch.full((2, 8), float(rank + 1))).sum().backward()
    return [p.grad.clone() for p in ddp.parameters() if p.grad is not None]


def test_comm_hook_on_a_ddp_built_elsewhere() -> None:
    g0, g1 = run_distributed(_comm_hook_on_bare_ddp, world_size=2)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, b)  # both ranks got the same average
    # every dense gradient entry is non-zero here; top-k's average has at most 2k of them
    total = sum(g.numel() for g in g0)
    nonzero = sum(int(g.count_nonzero()) for g in g0)
    assert 0 < nonzero <= 2 * round(0.1 * total) + 2


def test_api_errors_list_the_accepted_options() -> None:
    """The command line's "accepted: ..." lists, in the library too (a typo used to show
    a raw __init__ TypeError)."""
    with pytest.raises(ValueError, match=r"no option 'rnak' \(accepted: rank, .*warmup"):
        comm_hook("acpsgd:rnak=4")
    with pytest.raises(ValueError, match=r"no option 'ratoi' \(accepted: ratio\)"):
        make_compressor("topk", ratoi=0.1)
