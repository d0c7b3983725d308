"""Profiling a model on this device, and `plait plan` end to end (one process)."""

from __future__ import annotations

import pytest
import torch

from plait.cli import main as cli_main
from plait.parallel.planner import compute_slots, profile_model
from tests.parallel.common import batches, gpt, loss_fn


def test_profile_measures_time_blocks_and_activations() -> None:
    xs, ys = batches(1)
    prof = profile_model(gpt(), xs[0], ys[0], loss_fn=loss_fn, repeats=1)
    assert prof.sample_s > 0 and 0 < prof.block_share < 1
    assert prof.acts.block > 0 and prof.acts.block_input > 0
    assert all(t >= 0 for t in prof.tp_overhead_s)


def test_profile_leaves_the_model_untouched() -> None:
    model = gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    xs, ys = batches(1)
    profile_model(model, xs[0], ys[0], loss_fn=loss_fn, repeats=1)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_compute_slots_without_a_group_is_one() -> None:
    assert compute_slots() == 1


def test_plait_plan_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli_main(
            # the training-size MLP (--data real): the advice times torch's Muon, whose
            # Newton-Schulz runs in bfloat16, slow on a CPU without native bfloat16 (AVX2
            # only); with the bench-size MLP the test ran past pytest's 600 s limit there,
            # inside that timing, on a loaded host
            [
                "plan",
                "--workload",
                "mlp",
                "--data",
                "real",
                "--nodes",
                "2",
                "--memory",
                "1GiB",
                "--bandwidth",
                "slow",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "**chosen**" in out and "predicted" in out
    with pytest.raises(SystemExit):  # bad input is a usage error, not a traceback
        cli_main(["plan", "--workload", "mlp", "--memory", "lots"])
