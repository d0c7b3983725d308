"""`plait bench-fused`: fused arrays against serial training and torch.func's vmap."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from plait.cli.common import check_device, int_at_least, ints_arg, writable_dir
from plait.flags import add_options, build, option


@dataclass(frozen=True, kw_only=True)
class BenchFusedCommandConfig:
    """What `plait bench-fused` measures: the schema of its flags (`plait.flags`).

    The library's `plait.bench.fused.BenchConfig` is built from it in `run_config` (the
    throughput), or the fidelity run's arguments are. The constructor checks what the
    values alone decide (ValueError naming the flag); `validate` builds one model of each
    workload and checks the device and the folder.

    Attributes:
        workload: the models, comma-separated (short names, workloads or factories).
        n: the array sizes.
        strategies: the strategies compared, comma-separated.
        steps: timed steps per round.
        rounds: interleaved rounds per strategy.
        warmup: untimed steps before the rounds.
        threads: the intra-op thread counts every strategy runs at.
        batch_size: per-model batch size (default: the model's).
        device: cpu, cuda or cuda:N.
        out: output directory, None for none.
        default_malloc: keep glibc's malloc thresholds.
        stock_adam: the torch.optim.Adam implementation of the unfused strategies.
        native: the fused arrays may use plait's native CPU kernels.
        conv_layout: the fused arrays' 2-d convolution layout.
        fidelity: measure fidelity over this many steps instead of throughput.
    """

    workload: str = option(
        "mlp,cnn,transformer",
        "models to benchmark, comma-separated: the short names mlp, cnn, "
        "transformer (and -wide: digits-* workloads at fixed widths), any "
        "registry workload, or a factory pkg.module:factory or "
        "path/to/file.py:factory (--models is the earlier name)",
        aliases=("--models",),
        metavar="MODELS",
    )
    n: tuple[int, ...] = option((1, 2, 4, 8, 16, 32), "array sizes", parse=ints_arg)
    strategies: str = option(
        "fused,serial,concurrent,vmap", "fused, serial, concurrent, vmap (comma-separated)"
    )
    steps: int = option(5, "timed steps per round")
    rounds: int = option(9, "interleaved rounds per strategy")
    warmup: int = option(3, "untimed steps before the rounds")
    threads: tuple[int, ...] = option(
        (1,),
        "intra-op thread counts of every process, e.g. 1,2: every strategy runs at each",
        parse=ints_arg,
    )
    batch_size: int | None = option(None, "per-model batch size")
    device: str = option("cpu", "cpu or cuda")
    out: str | None = option(None, "output directory (results.json/.md/.png)")
    default_malloc: bool = option(False, "keep glibc's malloc thresholds (default: raised)")
    stock_adam: Literal["fused", "foreach", "for-loop"] = option(
        "fused",
        "torch.optim.Adam implementation of the serial, concurrent and vmap "
        "strategies (default: fused, the kernel FusedAdam runs too)",
    )
    native: bool = option(
        True,
        "fused arrays on torch's kernels only, without plait's native CPU "
        "kernels (plait.fused.native)",
    )
    conv_layout: Literal["nchw", "channels_last"] = option(
        "nchw",
        "layout of the fused arrays' 2-d convolutions (default nchw, the accurate "
        "one; channels_last is faster on a CPU, see plait.fused.set_conv_layout)",
    )
    fidelity: int | None = option(
        None,
        "measure fidelity instead of throughput: each array of --n models trains STEPS "
        "steps of SGD and of Adam fused and one model after another (float32 and float64), "
        "and the report gives each member's largest relative difference "
        "(DIR/fidelity.json, .md)",
        metavar="STEPS",
    )

    def __post_init__(self) -> None:
        from plait.bench.fused import MODEL_ALIASES, ArrayStrategy

        if not self.models():
            raise ValueError(
                f"--workload {self.workload!r}: choose from {', '.join(MODEL_ALIASES)}, a "
                "registry workload or a factory"
            )
        names = self.strategy_names()
        accepted = [s.value for s in ArrayStrategy]
        if not names or any(n not in accepted for n in names):
            raise ValueError(f"--strategies {self.strategies!r}: choose from {', '.join(accepted)}")
        for flag, values in (("--n", self.n), ("--threads", self.threads)):
            if any(v < 1 for v in values):
                raise ValueError(f"{flag} {','.join(map(str, values))}: expected integers >= 1")
        for flag in ("steps", "rounds", "batch_size"):
            int_at_least(f"--{flag.replace('_', '-')}", getattr(self, flag), 1)
        int_at_least("--warmup", self.warmup, 0)
        if self.fidelity is not None:
            int_at_least("--fidelity", self.fidelity, 1)
            if self.device != "cpu":
                raise ValueError(
                    "--fidelity measures on the CPU (float64 references): drop --device"
                )

    def models(self) -> list[str]:
        """The models' names, in order."""
        return [m.strip() for m in self.workload.split(",") if m.strip()]

    def strategy_names(self) -> list[str]:
        """The strategies' names, in order."""
        return [s.strip() for s in self.strategies.split(",") if s.strip()]


def add_parser(sub: Any) -> None:
    f = sub.add_parser(
        "bench-fused",
        help="throughput of N models trained fused vs serially, as processes, with vmap",
    )
    add_options(f, BenchFusedCommandConfig)


def validate(args: argparse.Namespace) -> None:
    from plait.bench.fused import get_model

    cfg = build(args, BenchFusedCommandConfig)
    for m in cfg.models():
        get_model(m)  # resolves the workload and builds one model: errors name it
    check_device("--device", cfg.device)
    writable_dir("--out", cfg.out)


def run(args: argparse.Namespace) -> int:
    return run_config(build(args, BenchFusedCommandConfig))


def run_config(cfg: BenchFusedCommandConfig) -> int:
    """Measure what `cfg` describes: the strategies' throughput, or with ``--fidelity``
    how far fused training strays from one model after another."""
    from plait.bench.fused import ArrayStrategy, BenchConfig, StockAdam, run_bench_fused
    from plait.bench.fused.report import markdown_table, write_reports

    if cfg.fidelity is not None:
        from plait.bench.fused import fidelity
        from plait.fused.ops.conv import set_conv_layout

        layout = set_conv_layout(cfg.conv_layout)
        try:
            results = fidelity.run_fidelity(
                cfg.models(), sizes=cfg.n, steps=cfg.fidelity, batch=cfg.batch_size
            )
        finally:
            set_conv_layout(layout)
        print(fidelity.markdown(results))
        if cfg.out:
            written = fidelity.write_reports(results, Path(cfg.out))
            print("wrote " + ", ".join(map(str, written)))
        return 0
    bench = BenchConfig(
        models=tuple(cfg.models()),
        sizes=cfg.n,
        strategies=tuple(ArrayStrategy(s) for s in cfg.strategy_names()),
        steps=cfg.steps,
        rounds=cfg.rounds,
        warmup=cfg.warmup,
        threads=cfg.threads,
        batch_size=cfg.batch_size,
        device=cfg.device,
        tune_malloc=not cfg.default_malloc,
        stock_adam=StockAdam(cfg.stock_adam),
        native_kernels=cfg.native,
        conv_layout=cfg.conv_layout,
    )
    records = run_bench_fused(bench)
    print(markdown_table(records))
    if cfg.out:
        paths = write_reports(records, Path(cfg.out))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
