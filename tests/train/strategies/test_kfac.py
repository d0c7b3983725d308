"""The registered K-FAC strategies: names, options, and the training loop end to end."""

from __future__ import annotations

import warnings

import pytest

from plait.kfac import KFACConfig
from plait.kfac.pipeline import FactorComm, FactorSync
from plait.kfac.placement import Distribution
from plait.train.strategies.kfac import PRESETS, KFACPreset, KFACStrategy
from plait.train.strategy import available_strategies, make_strategy


def test_strategies_are_registered_with_their_mechanics() -> None:
    assert {"kfac-naive", "kfac-static", "spd-kfac"} <= set(available_strategies())
    naive = make_strategy("kfac-naive")
    assert isinstance(naive, KFACStrategy)
    assert naive.config.comm == "after-backward" and naive.config.placement == "round-robin"
    spd = make_strategy("spd-kfac:inv_interval=10,method=eigen,comm_dtype=bf16")
    assert isinstance(spd, KFACStrategy)
    assert spd.config.inv_interval == 10 and spd.config.method == "eigen"
    assert spd.describe() == "spd-kfac:comm_dtype=bf16,inv_interval=10,method=eigen"
    assert set(PRESETS) == {"kfac-naive", "kfac-static", "spd-kfac"}


def test_presets_are_typed_configs_and_specs_still_name_them() -> None:
    assert set(PRESETS) == set(KFACPreset)
    assert all(isinstance(cfg, KFACConfig) for cfg in PRESETS.values())
    spd = PRESETS[KFACPreset.SPD]
    assert spd.sync is FactorSync.LAZY and spd.distribution is Distribution.AUTO
    assert PRESETS[KFACPreset.NAIVE].comm is FactorComm.AFTER_BACKWARD
    # a preset by enum or by name; options override its fields, typed like the config's
    by_enum = KFACStrategy(preset=KFACPreset.STATIC, inv_interval=5)
    assert by_enum.name == "kfac-static" and by_enum.config.comm is FactorComm.STATIC
    assert by_enum.config.inv_interval == 5 and PRESETS[KFACPreset.STATIC].inv_every == 1
    auto = make_strategy("spd-kfac:factor_interval=auto,inv_interval=auto,auto_overhead=0.1")
    assert isinstance(auto, KFACStrategy) and auto.config.auto_intervals
    assert auto.config.auto_overhead == 0.1 and auto.config.sync is FactorSync.LAZY
    with pytest.raises(ValueError, match="unknown K-FAC preset 'kfac-fast'"):
        KFACStrategy(preset="kfac-fast")


def test_check_refuses_a_model_with_no_supported_layer_before_launch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from torch import nn

    strategy = make_strategy("spd-kfac")
    strategy.check(nn.Sequential(nn.Linear(4, 2)), world=2)  # fine: nothing raised
    with pytest.raises(ValueError, match=r"'spd-kfac'.*no layer to precondition in Norms"):

        class Norms(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.norm = nn.LayerNorm(4)

        strategy.check(Norms(), world=2)
    strategy.close()

    # the CLI's parent process refuses it (exit 2, one line) before any cluster or torchrun
    from plait.cli import main

    argv = ["train", "--workload", "mlp", "--strategy", "spd-kfac:skip_layers=*", "--nodes", "2"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "no layer to precondition in" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("spd-kfac:damping=0", "damping"),
        ("kfac-static:inv_interval=0", "inv_interval"),
        ("kfac-naive:method=svd", "unknown method"),
        ("spd-kfac:compression=zip", "unknown compressor"),
        ("spd-kfac:rank=4", "invalid options"),  # ssgd takes no rank
    ],
)
def test_bad_options_are_value_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_strategy(spec)


def test_trainer_runs_spd_kfac_on_digits(tmp_path: object) -> None:
    """`plait train --strategy spd-kfac` in one process: learns, and checkpoints K-FAC."""
    from plait.train.loop import TrainConfig, Trainer

    cfg = TrainConfig(workload="mlp", strategy="spd-kfac:inv_interval=5", steps=30,
                      eval_every=15, progress=False, lr=0.03,
                      checkpoint=str(tmp_path), checkpoint_every=15)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(cfg)
    try:
        trainer.run()
        curve = trainer.state.curve
        assert [p["step"] for p in curve] == [15, 30]
        assert curve[-1]["test_accuracy"] > 0.8  # ten classes: chance is 0.1
        state = trainer.strategy.state_dict()
        assert state["kfac"]["steps"] == 30 and "second_order" in state["kfac"]
    finally:
        trainer.close()


def test_compute_only_step_leaves_the_state_as_it_was() -> None:
    """The benchmark's compute-only reference: factors, decompositions and preconditioning
    are computed, but K-FAC's step counter and running factors do not move."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    strategy = make_strategy("spd-kfac:inv_interval=3,factor_interval=2,probe=false")
    assert isinstance(strategy, KFACStrategy)
    model = strategy.wrap(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy.attach_optimizer(opt)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    for _ in range(4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        strategy.before_optimizer_step(model)
        opt.step()
    kfac = strategy.kfac
    assert kfac is not None
    before = kfac.state_dict()
    opt.zero_grad()
    with strategy.compute_only(model):
        nn.functional.cross_entropy(model(x), y).backward()
        raw = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        strategy.before_optimizer_step(model)
    after = kfac.state_dict()
    assert after["steps"] == before["steps"] == 4
    assert torch.equal(after["pipeline"]["running"], before["pipeline"]["running"])
    # the gradients were preconditioned all the same (the work being timed)
    now = [p.grad for p in model.parameters()]
    assert any(g is not None and not torch.equal(r, g) for r, g in zip(raw, now, strict=True))
    strategy.close()
