"""Fidelity: what each data-parallel strategy does to the final test metric.

Speed is only half of a compressor's story; the other half is the model it trains. This
runs ``plait train`` on real data (the bundled digits, the pydoc text) once per
(workload, strategy) on one emulated cluster, with the same seed, data order, epochs and
optimizer, and tabulates the final test loss and accuracy (per token for the GPT) next to
the first strategy's (S-SGD, the reference):

    plait bench fidelity --workload resnet18,gpt \\
        --strategies ssgd,fp16,signsgd,topk,powersgd:rank=4,acpsgd:rank=4 --out DIR

It writes ``DIR/results.json`` (the training summaries, with the command) and
``DIR/results.md`` (the table).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path

from plait._proc import keep_scratch, scratch_dir
from plait.bench import suites
from plait.bench.records import FidelityRecord
from plait.cluster import Cluster, NetworkSpec, launch
from plait.flags import option
from plait.records import stamp, write_report
from plait.train.strategy import make_strategy
from plait.workloads import get_workload

logger = logging.getLogger(__name__)


def run_fidelity(
    *,
    workloads: Sequence[str],
    strategies: Sequence[str],
    nodes: int = 4,
    epochs: int | None = None,
    bandwidth: str = "fast",
    seed: int = 0,
    timeout_s: float = 3600.0,
    command: str = "",
) -> list[FidelityRecord]:
    """Train every (workload, strategy) and return one record each."""
    for w in workloads:
        get_workload(w)
    for s in strategies:
        make_strategy(s).close()
    if epochs is not None and epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    work = scratch_dir("plait-fidelity-")
    records: list[FidelityRecord] = []
    with Cluster.create(nodes=nodes, network=NetworkSpec(bandwidth=bandwidth)) as cluster:
        for w in workloads:
            n_epochs = epochs or get_workload(w).epochs
            for i, s in enumerate(strategies):
                out = work / f"{w}-{i}.json"
                argv = [
                    "plait.train",
                    "--workload",
                    w,
                    "--strategy",
                    s,
                    "--epochs",
                    str(n_epochs),
                    "--seed",
                    str(seed),
                    "--out",
                    str(out),
                    "--no-progress",
                ]
                logger.info("fidelity: %s / %s, %d epoch(s) on %d node(s)", w, s, n_epochs, nodes)
                res = launch(cluster, argv, module=True, timeout_s=timeout_s, quiet=True)
                if not res.ok or not out.exists():
                    keep_scratch(work)
                    raise RuntimeError(f"training {w} with {s} failed:\n{res.tail()}")
                summary = json.loads(out.read_text())
                final = summary["final"]
                records.append(
                    FidelityRecord(
                        workload=w,
                        strategy=s,
                        epochs=n_epochs,
                        nodes=nodes,
                        data=summary["data"],
                        steps=summary["steps"],
                        batch_size=summary["batch_size"],
                        test_loss=final.get("test_loss"),
                        test_accuracy=final.get("test_accuracy"),
                        history=summary["history"],
                    )
                )
    return stamp(records, command=command)


def markdown(records: Sequence[FidelityRecord]) -> str:
    """The table: final test metrics, and accuracy points against each workload's first row
    (a metric the workload does not report shows as "-")."""
    lines = [
        "| workload | data | epochs | strategy | test loss | test accuracy | vs first |",
        "|---|---|---|---|---|---|---|",
    ]
    first: dict[str, float] = {}
    for r in records:
        loss = "-" if r.test_loss is None else f"{r.test_loss:.4f}"
        if r.test_accuracy is None:
            acc_text, delta = "-", "-"
        else:
            acc = 100 * r.test_accuracy
            ref = first.setdefault(r.workload, acc)
            acc_text, delta = f"{acc:.2f}%", f"{acc - ref:+.2f} pt"
        lines.append(
            f"| {r.workload} | {r.data} | {r.epochs} | {r.strategy} | "
            f"{loss} | {acc_text} | {delta} |"
        )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True)
class FidelityConfig:
    """The command line of ``plait bench fidelity`` (its flags, `plait.flags`).

    Attributes:
        workload: the workloads trained, comma-separated.
        strategies: the strategy specs, separated by ``;`` (or by ``,`` between names);
            the first is the reference.
        nodes: the emulated cluster's nodes.
        epochs: training epochs (default: each workload's own).
        bandwidth: the link rate (it changes the time, not the model trained).
        seed: weights and data order of every run.
        out: the folder of ``results.json`` and ``results.md``.
    """

    workload: str = option("resnet18", "workload(s), comma-separated")
    strategies: str = option(
        "ssgd,acpsgd:rank=4", "strategy specs separated by ';' (or by ',' between names)"
    )
    nodes: int = option(4)
    epochs: int | None = option(None, "default: each workload's own")
    bandwidth: str = option("fast", "link rate (speed plays no part here)")
    seed: int = option(0)
    out: str = option(MISSING, "output directory")


def run_parsed(cfg: FidelityConfig, call: suites.Call) -> int:
    """Train every (workload, strategy), write the report and print its table."""
    from plait.specs import split_specs

    command = call.quoted
    records = run_fidelity(
        workloads=[w.strip() for w in cfg.workload.split(",") if w.strip()],
        strategies=split_specs(cfg.strategies),
        nodes=cfg.nodes,
        epochs=cfg.epochs,
        bandwidth=cfg.bandwidth,
        seed=cfg.seed,
        command=command,
    )
    table = markdown(records)
    write_report(Path(cfg.out), records, title="Fidelity", command=command, body=table)
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.fidelity``: the suite ``fidelity`` (`plait.bench.suites`)."""
    return suites.main("fidelity", argv)


if __name__ == "__main__":
    sys.exit(main())
