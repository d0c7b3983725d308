"""The fused throughput benchmark runs every strategy and writes its reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.bench.fused import ArrayStrategy, BenchConfig, StockAdam, run_bench_fused, runner
from plait.bench.fused.report import write_reports


def test_every_strategy_measures_and_reports(tmp_path: Path) -> None:
    cfg = BenchConfig(
        models=("cnn",),
        sizes=(2,),
        strategies=tuple(ArrayStrategy),
        steps=1,
        rounds=2,
        warmup=1,
        batch_size=4,
    )
    records = run_bench_fused(cfg)
    assert {r.strategy for r in records} == {s.value for s in ArrayStrategy}
    for r in records:
        assert r.n == 2 and r.bandwidth == "n2" and r.threads == 1
        assert 0 < r.iter_time_min_s <= r.iter_time_s <= r.iter_time_max_s
    paths = write_reports(records, tmp_path)
    saved = json.loads(paths["json"].read_text())
    assert saved[0]["commit"] and saved[0]["machine"]["cpus"]
    assert "fused vs serial wall [CPU]" in paths["markdown"].read_text()
    assert paths["png"].stat().st_size > 0


def test_thread_counts_are_contestants_and_the_best_of_each_is_compared() -> None:
    from plait.bench.fused.report import markdown_table

    cfg = BenchConfig(
        models=("mlp",),
        sizes=(2,),
        strategies=(ArrayStrategy.FUSED, ArrayStrategy.SERIAL),
        steps=1,
        rounds=2,
        warmup=1,
        batch_size=4,
        threads=(1, 2),
    )
    records = run_bench_fused(cfg)
    assert sorted((r.strategy, r.threads) for r in records) == [
        ("fused", 1),
        ("fused", 2),
        ("serial", 1),
        ("serial", 2),
    ]
    for r in records:  # speed-ups compare thread for thread
        serial = next(s for s in records if s.strategy == "serial" and s.threads == r.threads)
        assert r.speedup_vs_serial == pytest.approx(serial.iter_time_s / r.iter_time_s)
    table = markdown_table(records)
    best = {
        s: min((r for r in records if r.strategy == s), key=lambda r: r.iter_time_s)
        for s in ("fused", "serial")
    }
    # The whole-machine records (each strategy at its fastest count) lead the JSON.
    assert [r.fastest_threads for r in records] == [True, True, False, False]
    assert {r.strategy: r for r in records[:2]} == best
    for r in records:
        ratio_best = best["serial"].iter_time_s / r.iter_time_s
        assert r.speedup_vs_fastest_serial == pytest.approx(ratio_best)
    row = table.split("fastest thread count")[1].splitlines()[4]
    ratio = best["serial"].iter_time_s / best["fused"].iter_time_s
    assert f"@ {best['fused'].threads}" in row and f"{ratio:.2f}x" in row


def test_concurrent_processes_never_oversubscribe_the_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from plait.bench.fused import runner

    monkeypatch.setattr(runner, "usable_cpus", lambda: 2)
    cfg = BenchConfig(
        models=("mlp",),
        sizes=(1, 2),
        strategies=(ArrayStrategy.CONCURRENT,),
        steps=1,
        rounds=1,
        warmup=1,
        batch_size=4,
        threads=(1, 2),
    )
    got = sorted((r.n, r.threads) for r in run_bench_fused(cfg))
    assert got == [(1, 1), (1, 2), (2, 1)]  # 2 processes x 2 threads > 2 CPUs: skipped


def test_bad_configuration() -> None:
    with pytest.raises(ValueError, match="unknown benchmark model 'alexnet'"):
        BenchConfig(models=("alexnet",))
    with pytest.raises(ValueError):
        BenchConfig(sizes=(0,))
    with pytest.raises(ValueError, match="thread counts must be >= 1"):
        BenchConfig(threads=(1, 0))
    with pytest.raises(ValueError, match="conv layout 'nhwc'"):
        BenchConfig(conv_layout="nhwc")


def test_conv_layout_applies_during_the_run_and_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused arrays' convolutions take the layout asked for while the benchmark runs,
    the records name it, and the layout before is restored."""
    from plait.fused.ops import conv

    seen: list[str] = []
    measure = runner._measure

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(conv._layout["conv2d"])
        return measure(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "_measure", spy)
    cfg = BenchConfig(models=("mlp",), sizes=(2,), strategies=(ArrayStrategy.FUSED,),
                      steps=1, rounds=1, warmup=0, conv_layout="channels_last")  # fmt: skip
    (record,) = run_bench_fused(cfg)
    assert seen == ["channels_last"] and record.conv_layout == "channels_last"
    assert conv._layout["conv2d"] == "nchw"


def test_malloc_tuning_reports_whether_it_applied() -> None:
    from plait.fused.malloc import tune_malloc

    assert isinstance(tune_malloc(), bool)


@pytest.mark.parametrize("adam", list(StockAdam))
def test_stock_strategies_use_the_chosen_adam(adam: StockAdam) -> None:
    from plait.bench.fused.models import get_model
    from plait.bench.fused.strategies import Serial, Vmap, make_runner

    model = get_model("mlp")
    serial = make_runner(
        ArrayStrategy.SERIAL, model, 2, batch=4, threads=1, device="cpu", adam=adam
    )
    vmap = make_runner(ArrayStrategy.VMAP, model, 2, batch=4, threads=1, device="cpu", adam=adam)
    assert isinstance(serial, Serial) and isinstance(vmap, Vmap)
    for opt in serial.opts:
        assert bool(opt.defaults["fused"]) is (adam is StockAdam.FUSED)
        assert bool(opt.defaults["foreach"]) is (adam is StockAdam.FOREACH)
    # torch.func's peer steps with torch's functional Adam, in the same implementation
    assert vmap.fused is (adam is StockAdam.FUSED)
    assert vmap.foreach is (adam is StockAdam.FOREACH)
    serial.run(1)  # every implementation steps on CPU
    vmap.run(1)
    cfg = BenchConfig(
        models=("mlp",),
        sizes=(1,),
        strategies=(ArrayStrategy.SERIAL,),
        steps=1,
        rounds=1,
        warmup=1,
        batch_size=4,
        stock_adam=adam,
    )
    assert run_bench_fused(cfg)[0].stock_adam == adam.value


@pytest.mark.parametrize(
    ("name", "workload", "width", "params"),
    [
        # parameter counts of the models the benchmark measured before it used the registry
        ("mlp", "digits-mlp", 64, 8970),
        ("cnn", "digits-cnn", 8, 5122),
        ("transformer", "digits-transformer", 16, 5930),
        ("mlp-wide", "digits-mlp", 128, 26122),
        ("cnn-wide", "digits-cnn", 16, 19706),
        ("transformer-wide", "digits-transformer", 32, 20042),
    ],
)
def test_short_names_are_registry_workloads_at_fixed_widths(
    name: str, workload: str, width: int, params: int
) -> None:
    from plait.bench.fused.models import get_model

    model = get_model(name)
    assert model.workload.name == workload and dict(model.arch) == {"width": width}
    assert sum(p.numel() for p in model.build().parameters()) == params
    assert model.batch_size == 32 and model.num_classes == 10
    x = model.inputs(2, 3, torch.Generator().manual_seed(0))
    assert x.shape[:2] == (2, 3) and model.build()(x[0]).shape == (3, 10)


def test_registry_workloads_and_factories_are_benchmark_models(tmp_path: Path) -> None:
    from plait.bench.fused.models import get_model

    assert get_model("digits-cnn").arch == {} and "width 8" in get_model("digits-cnn").description
    (tmp_path / "wl.py").write_text(
        "from plait.workloads import WORKLOADS\n"
        "from dataclasses import replace\n"
        "def small():\n"
        "    return replace(WORKLOADS['digits-mlp'], name='small', arch={'width': 8})\n"
    )
    model = get_model(f"{tmp_path / 'wl.py'}:small")
    assert model.workload.name == "small" and "width 8" in model.description
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        get_model(f"{tmp_path / 'wl.py'}:nope")
