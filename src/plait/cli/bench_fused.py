"""`plait bench-fused`: fused arrays against serial training and torch.func's vmap."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from plait.cli.common import check_device, int_at_least, ints_arg, writable_dir


def add_parser(sub: Any) -> None:
    f = sub.add_parser(
        "bench-fused",
        help="throughput of N models trained fused vs serially, as processes, with vmap",
    )
    f.add_argument(
        "--workload",
        "--models",
        dest="models",
        default="mlp,cnn,transformer",
        help="models to benchmark, comma-separated: the short names mlp, cnn, "
        "transformer (and -wide: digits-* workloads at fixed widths), any "
        "registry workload, or a factory pkg.module:factory or "
        "path/to/file.py:factory (--models is the earlier name)",
    )
    f.add_argument("--n", type=ints_arg, default=(1, 2, 4, 8, 16, 32), help="array sizes")
    f.add_argument(
        "--strategies",
        default="fused,serial,concurrent,vmap",
        help="fused, serial, concurrent, vmap (comma-separated)",
    )
    f.add_argument("--steps", type=int, default=5, help="timed steps per round")
    f.add_argument("--rounds", type=int, default=9, help="interleaved rounds per strategy")
    f.add_argument("--warmup", type=int, default=3, help="untimed steps before the rounds")
    f.add_argument(
        "--threads",
        type=ints_arg,
        default=(1,),
        help="intra-op thread counts of every process, e.g. 1,2: every strategy runs at each",
    )
    f.add_argument("--batch-size", type=int, default=None, help="per-model batch size")
    f.add_argument("--device", default="cpu", help="cpu or cuda")
    f.add_argument("--out", default=None, help="output directory (results.json/.md/.png)")
    f.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's malloc thresholds (default: raised)",
    )
    f.add_argument(
        "--stock-adam",
        default="fused",
        choices=["fused", "foreach", "for-loop"],
        help="torch.optim.Adam implementation of the serial, concurrent and vmap "
        "strategies (default: fused, the kernel FusedAdam runs too)",
    )
    f.add_argument(
        "--no-native",
        action="store_true",
        help="fused arrays on torch's kernels only, without plait's native CPU "
        "kernels (plait.fused.native)",
    )
    f.add_argument(
        "--conv-layout",
        default="nchw",
        choices=["nchw", "channels_last"],
        help="layout of the fused arrays' 2-d convolutions (default nchw, the accurate "
        "one; channels_last is faster on a CPU, see plait.fused.set_conv_layout)",
    )
    f.add_argument(
        "--fidelity",
        type=int,
        default=None,
        metavar="STEPS",
        help="measure fidelity instead of throughput: each array of --n models trains STEPS "
        "steps of SGD and of Adam fused and one model after another (float32 and float64), "
        "and the report gives each member's largest relative difference "
        "(DIR/fidelity.json, .md)",
    )


def validate(args: argparse.Namespace) -> None:
    from plait.bench.fused import MODEL_ALIASES, ArrayStrategy, get_model

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise ValueError(
            f"--workload {args.models!r}: choose from {', '.join(MODEL_ALIASES)}, a registry "
            "workload or a factory"
        )
    for m in models:
        get_model(m)  # resolves the workload and builds one model: errors name it
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    accepted = [s.value for s in ArrayStrategy]
    if not names or any(n not in accepted for n in names):
        raise ValueError(f"--strategies {args.strategies!r}: choose from {', '.join(accepted)}")
    for flag, values in (("--n", args.n), ("--threads", args.threads)):
        if any(v < 1 for v in values):
            raise ValueError(f"{flag} {','.join(map(str, values))}: expected integers >= 1")
    for flag in ("steps", "rounds", "batch_size"):
        int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    int_at_least("--warmup", args.warmup, 0)
    check_device("--device", args.device)
    writable_dir("--out", args.out)
    if args.fidelity is not None:
        int_at_least("--fidelity", args.fidelity, 1)
        if args.device != "cpu":
            raise ValueError("--fidelity measures on the CPU (float64 references): drop --device")


def run(args: argparse.Namespace) -> int:
    from plait.bench.fused import ArrayStrategy, BenchConfig, StockAdam, run_bench_fused
    from plait.bench.fused.report import markdown_table, write_reports

    if args.fidelity is not None:
        from plait.bench.fused import fidelity
        from plait.fused.ops.conv import set_conv_layout

        models = [m.strip() for m in args.models.split(",") if m.strip()]
        layout = set_conv_layout(args.conv_layout)
        try:
            results = fidelity.run_fidelity(
                models, sizes=args.n, steps=args.fidelity, batch=args.batch_size
            )
        finally:
            set_conv_layout(layout)
        print(fidelity.markdown(results))
        if args.out:
            written = fidelity.write_reports(results, Path(args.out))
            print("wrote " + ", ".join(map(str, written)))
        return 0
    cfg = BenchConfig(
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        sizes=args.n,
        strategies=tuple(ArrayStrategy(s.strip()) for s in args.strategies.split(",") if s.strip()),
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        threads=args.threads,
        batch_size=args.batch_size,
        device=args.device,
        tune_malloc=not args.default_malloc,
        stock_adam=StockAdam(args.stock_adam),
        native_kernels=not args.no_native,
        conv_layout=args.conv_layout,
    )
    records = run_bench_fused(cfg)
    print(markdown_table(records))
    if args.out:
        paths = write_reports(records, Path(args.out))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
