"""What the projection is for: checks against the emulated cluster, time to the races'
target, the map of which method wins where, and `plait plan`'s data-parallel advice."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.bench.project.profile import Profile, measure_profile
from plait.bench.project.step import (
    KFAC_PRESETS,
    kfac_layers,
    profile_key,
    project,
    projectable,
)
from plait.comm import AlphaBeta
from plait.comm.cost import Algorithms
from plait.comm.link import link_model
from plait.specs import parse_spec

#: The projection's goal against the emulated cluster: every step within 15%.
TOLERANCE = 0.15


@dataclass(frozen=True, kw_only=True)
class Check:
    """One emulated measurement against its projection."""

    workload: str
    strategy: str
    nodes: int
    bandwidth: str
    rate: str
    measured_s: float
    compute_s: float
    predicted_s: float
    source: str

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0

    @property
    def ok(self) -> bool:
        return abs(self.error) <= TOLERANCE


def host_cost(probe: Mapping[str, Any]) -> float:
    """Host CPU seconds per wire byte of the emulated cluster's collectives, from an
    unshaped `plait cluster probe` (its largest all-reduce's bus bandwidth): where nothing
    shapes the link, gloo's reductions and the kernel's TCP path on the shared cores are
    what limits a collective, so each byte costs the cores that much time."""
    return 8.0 / float(probe["busbw_bps"][-1])


def start_up_s(probe: Mapping[str, Any] | None) -> float:
    """A message's start-up time on the job's links, from the probe the benchmark harness
    ran at the job's start: the alpha of its alpha-beta fit over every sample (three sizes,
    three all-reduces each; 0 without a probe).

    On the emulated cluster a message costs up to a millisecond or two (gloo's handshakes
    and the kernel's TCP path on cores the ranks share), twenty times a bare link's alpha:
    the difference between a compressor's many small all-reduces and one large one. The
    fit, not the smallest size's time alone: one size's median of three can catch the ranks
    waking late on the shared cores (at 4 nodes and 5 Gbit/s a 16 KB all-reduce took 11 ms
    where 256 KB took 3 ms), which priced K-FAC's 78 per-factor all-reduces 25% too slow.
    """
    return max(0.0, float(probe.get("alpha_s", 0.0))) if probe else 0.0


def validate(
    profiles: Mapping[str, Profile],
    records: Sequence[Mapping[str, Any]],
    *,
    source: str = "",
    host_s_per_byte: float = 0.0,
) -> list[Check]:
    """Predict every `plait bench` record of a profiled workload from its measured compute,
    its link's rate with the start-up time its job's probe measured (`start_up_s`), gloo's
    algorithms (as the emulated cluster runs them) and the emulated host's CPU cost per
    byte sent (`host_cost`)."""
    from plait.units import parse_duration, parse_rate

    out = []
    layer_cache: dict[str, Any] = {}
    for r in records:
        profile = profiles.get(str(r["workload"]))
        if profile is None or not r.get("rate"):
            continue
        latency = r.get("latency")
        link = link_model(
            parse_rate(str(r["rate"])), latency_s=parse_duration(latency) if latency else 0.0
        )
        link = AlphaBeta(alpha=max(link.alpha, start_up_s(r.get("probe"))), beta=link.beta)
        spec = str(r["strategy_spec"])
        layers = None
        if parse_spec(spec)[0] in KFAC_PRESETS:
            layers = layer_cache.setdefault(profile.workload, kfac_layers(profile))
        est = project(
            profile,
            spec,
            world=int(r["world_size"]),
            link=link,
            algorithms=Algorithms.GLOO,
            compute_s=float(r["compute_time_s"]),
            layers=layers,
            host_s_per_byte=host_s_per_byte,
        )
        out.append(
            Check(
                workload=profile.workload,
                strategy=spec,
                nodes=int(r["nodes"]),
                bandwidth=str(r["bandwidth"]),
                rate=str(r["rate"]),
                measured_s=float(r["iter_time_s"]),
                compute_s=float(r["compute_time_s"]),
                predicted_s=est.step_s,
                source=source,
            )
        )
    return out


def checks_markdown(checks: Sequence[Check]) -> str:
    lines = [
        "| workload | strategy | nodes | bandwidth | compute-only s | measured s | "
        "projected s | error | within 15% |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c.workload} | {c.strategy} | {c.nodes} | {c.bandwidth} ({c.rate}) | "
            f"{c.compute_s:.3f} | {c.measured_s:.3f} | {c.predicted_s:.3f} | "
            f"{100 * c.error:+.1f}% | {'yes' if c.ok else '**no**'} |"
        )
    n_ok = sum(c.ok for c in checks)
    worst = max((abs(c.error) for c in checks), default=0.0)
    lines += ["", f"{n_ok} of {len(checks)} within 15%; largest error {100 * worst:.1f}%."]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A data-parallel strategy with an optimizer, and its steps to the races' target."""

    spec: str
    optimizer: str
    steps: float | None  # median steps to target over the races that measured it
    label: str

    @property
    def name(self) -> str:
        return f"{self.spec}+{self.optimizer}"


def race_candidates(races: Sequence[Path], workload: str) -> list[Candidate]:
    """Every (strategy, optimizer) the races of `workload` took to their target, with the
    median of their steps to target over those races (entries that never reached it left
    out: their time to target is unknown). A results.json that is not a race's list of
    entries (a study's record in the same folder) is skipped."""
    seen: dict[tuple[str, str], list[float]] = {}
    for path in races:
        doc = json.loads(Path(path).read_text())
        for r in doc if isinstance(doc, list) else []:
            if not isinstance(r, dict) or "spec" not in r or "optimizer" not in r:
                continue
            if r.get("workload") != workload or r.get("steps_to_target") is None:
                continue
            seen.setdefault((r["spec"], r["optimizer"]), []).append(float(r["steps_to_target"]))
    return [
        Candidate(spec=s, optimizer=o, steps=statistics.median(v), label=f"{s}+{o}")
        for (s, o), v in sorted(seen.items())
    ]


@dataclass(kw_only=True)
class Cell:
    """One cluster: every candidate's step and time to target, and the winner."""

    nodes: int
    rate: str
    steps_s: dict[str, float]
    to_target_s: dict[str, float]
    winner: str


def cluster_map(
    profile: Profile,
    candidates: Sequence[Candidate],
    *,
    nodes: Sequence[int] = (8, 16, 32, 64),
    rates: Sequence[str] = ("1gbit", "10gbit", "25gbit", "100gbit"),
    algorithms: Algorithms = Algorithms.RING,
    speed: float = 1.0,
) -> list[Cell]:
    """Which candidate reaches the target first on each cluster (nodes x link rate)."""
    from plait.units import parse_rate

    layers = (
        kfac_layers(profile)
        if any(parse_spec(c.spec)[0] in KFAC_PRESETS for c in candidates)
        else None
    )
    cells = []
    for n in nodes:
        for rate in rates:
            link = link_model(parse_rate(rate))
            steps: dict[str, float] = {}
            target: dict[str, float] = {}
            for c in candidates:
                est = project(
                    profile,
                    projectable(c.spec),
                    world=n,
                    link=link,
                    algorithms=algorithms,
                    optimizer=c.optimizer,
                    layers=layers,
                    speed=speed,
                )
                steps[c.name] = est.step_s
                if c.steps is not None:
                    target[c.name] = est.step_s * c.steps
            ranked = target or steps
            cells.append(
                Cell(
                    nodes=n,
                    rate=rate,
                    steps_s=steps,
                    to_target_s=target,
                    winner=min(ranked, key=ranked.__getitem__),
                )
            )
    return cells


#: What `recommend` weighs when no race of the model is at hand: the data-parallel
#: strategies at rank 4 and SPD-KFAC, each with the workload's own optimizer.
DEFAULT_CANDIDATES = ("ssgd", "fp16", "powersgd:rank=4", "acpsgd:rank=4", "spd-kfac")


@dataclass(kw_only=True)
class Recommendation:
    """`plait plan`'s data-parallel advice: every candidate projected on one cluster."""

    workload: str
    world: int
    rate: str
    rows: list[tuple[str, float, float | None]]  # (candidate, step s, time to target s)
    by_target: bool  # ranked by time to the races' target (else by step time)

    @property
    def best(self) -> str:
        return self.rows[0][0]

    def text(self) -> str:
        what = "time to the races' target" if self.by_target else "step time (no race of it)"
        lines = [
            f"data-parallel strategy and optimizer for {self.workload} on {self.world} "
            f"node(s) at {self.rate}: {self.best} (projected, ranked by {what})",
            "",
            f"{'candidate':<60} {'step s':>9} {'to target s':>12}",
        ]
        for name, step, target in self.rows:
            t = f"{target:12.1f}" if target is not None else f"{'-':>12}"
            lines.append(f"{name:<60} {step:9.3f} {t}")
        return "\n".join(lines)


def recommend(
    workload: str,
    *,
    world: int,
    rate: str,
    races: Sequence[Path] = (),
    real: bool = False,
    optimizer: str | None = None,
) -> Recommendation:
    """Project every candidate on `world` nodes linked at `rate` (NCCL's ring algorithms)
    from a profile measured here; rank by time to the races' target where races of the
    model are given (`real`: the races train the training model), else by step time."""
    from plait.units import parse_rate
    from plait.workloads import get_workload

    wl = get_workload(workload)
    cands = race_candidates(races, workload) if real and races else []
    by_target = bool(cands)
    if not cands:
        from plait.kfac.preconditioner import select_layers

        opt = optimizer or wl.optimizer
        info = wl.real().info if real else wl.bench_data(8).info
        kfac_ok = bool(select_layers(wl.model(info, bench=not real)).layers)
        cands = [
            Candidate(spec=s, optimizer=opt, steps=None, label=s)
            for s in DEFAULT_CANDIDATES
            if kfac_ok or parse_spec(s)[0] not in KFAC_PRESETS
        ]
    specs = list(dict.fromkeys(profile_key(c.spec) for c in cands))
    prof = measure_profile(workload, specs, real=real, steps=3, warmup=1)
    link = link_model(parse_rate(rate))
    layers = kfac_layers(prof) if any(parse_spec(s)[0] in KFAC_PRESETS for s in specs) else None
    rows: list[tuple[str, float, float | None]] = []
    for c in cands:
        est = project(
            prof, projectable(c.spec), world=world, link=link, optimizer=c.optimizer, layers=layers
        )
        rows.append((c.name, est.step_s, est.step_s * c.steps if c.steps else None))
    rows.sort(key=lambda r: r[2] if r[2] is not None else r[1])
    return Recommendation(workload=workload, world=world, rate=rate, rows=rows, by_target=by_target)


def _seconds(t: float) -> str:
    return f"{1e3 * t:.1f} ms" if t < 1 else f"{t:.2f} s"


def map_markdown(cells: Sequence[Cell], *, title: str, heading: bool = True) -> str:
    """The map as Markdown: the winner per (nodes, rate), then every candidate's step.

    `heading`: start with `title` as a heading; a report that has its own title (the
    ``map.md`` `plait.records.write_report` writes) leaves it out.
    """
    rates = list(dict.fromkeys(c.rate for c in cells))
    nodes = list(dict.fromkeys(c.nodes for c in cells))
    by = {(c.nodes, c.rate): c for c in cells}
    lines = [f"## {title}", ""] if heading else []
    lines += [
        "| nodes | " + " | ".join(rates) + " |",
        "|---|" + "---|" * len(rates),
    ]
    for n in nodes:
        row = []
        for r in rates:
            c = by[n, r]
            best = c.to_target_s.get(c.winner) or c.steps_s[c.winner]
            row.append(f"**{c.winner}** {_seconds(best)}")
        lines.append(f"| {n} | " + " | ".join(row) + " |")
    lines += [
        "",
        "Step seconds of every candidate:",
        "",
        "| nodes | rate | " + " | ".join(cells[0].steps_s) + " |",
        "|---|---|" + "---|" * len(cells[0].steps_s),
    ]
    for c in cells:
        lines.append(
            f"| {c.nodes} | {c.rate} | " + " | ".join(f"{v:.3f}" for v in c.steps_s.values()) + " |"
        )
    return "\n".join(lines) + "\n"


def plot_map(cells: Sequence[Cell], path: Path, *, title: str) -> None:
    """The winner of each cluster as a coloured grid (nodes x link rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(c.rate for c in cells))
    nodes = list(dict.fromkeys(c.nodes for c in cells))
    winners = sorted({c.winner for c in cells})
    colour = {w: i for i, w in enumerate(winners)}
    grid = [
        [colour[next(c.winner for c in cells if c.nodes == n and c.rate == r)] for r in rates]
        for n in nodes
    ]
    fig, ax = plt.subplots(figsize=(1.8 * len(rates) + 2, 0.7 * len(nodes) + 2))
    ax.imshow(grid, cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for i, n in enumerate(nodes):
        for j, r in enumerate(rates):
            c = next(c for c in cells if c.nodes == n and c.rate == r)
            ax.text(j, i, c.winner.replace("+", "\n+"), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(rates)), rates)
    ax.set_yticks(range(len(nodes)), [str(n) for n in nodes])
    ax.set_xlabel("link rate per node")
    ax.set_ylabel("nodes")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
