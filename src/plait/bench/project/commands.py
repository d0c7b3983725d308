"""``plait bench project profile|validate|map``: the projection's commands.

``profile`` measures a workload into one profile file (JSON); ``validate`` writes its
checks with `plait.records.write_report` (``results.json``, ``results.md``); ``map``
writes the map with it too, named ``map.json``, ``map.md`` and ``map.png``. See
`plait.bench.project` for what is projected and how.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path

from plait.bench import suites
from plait.bench.project.advice import (
    Candidate,
    Check,
    checks_markdown,
    cluster_map,
    host_cost,
    map_markdown,
    plot_map,
    race_candidates,
    validate,
)
from plait.bench.project.profile import Profile, measure_profile
from plait.flags import option
from plait.records import write_report


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """``profile``: measure a workload's step on this process (`plait.flags`).

    Attributes:
        workload: the workload measured.
        strategies: the strategy specs profiled, separated by ``;``.
        real: the training model (the races'), not the benchmark model.
        device: the device the step runs on.
        steps: steps measured.
        out: the profile's JSON file.
    """

    workload: str = option(MISSING)
    strategies: str = option("", "specs; ';' between them")
    real: bool = option(False, "the training model (the races')")
    device: str = option("cpu")
    steps: int = option(5)
    out: Path = option(MISSING)


@dataclass(frozen=True, kw_only=True)
class ValidateConfig:
    """``validate``: the projection against emulated ``plait bench`` results.

    Attributes:
        profile: the workloads' profiles; one per flag.
        results: ``plait bench`` result folders; one per flag.
        host_probe: an unshaped probe of the emulated cluster (``plait cluster probe``'s
            JSON), which gives the host's CPU cost per byte sent.
        host_bps: that cost given as the unshaped links' all-reduce bus bandwidth, bit/s.
        out: the folder of ``results.json`` and ``results.md``.
    """

    profile: tuple[Path, ...] = option(MISSING)
    results: tuple[Path, ...] = option(MISSING)
    host_probe: Path | None = option(
        None,
        "an unshaped probe of the emulated cluster (JSON of plait cluster probe): "
        "the host's CPU cost per byte sent",
    )
    host_bps: float | None = option(
        None, "the same as a bus bandwidth in bit/s (the unshaped links' all-reduce rate)"
    )
    out: Path = option(MISSING)


@dataclass(frozen=True, kw_only=True)
class MapConfig:
    """``map``: which strategy and optimizer wins where, projected.

    Attributes:
        profile: the workload's profile.
        races: race results (folders or ``results.json`` files) whose runs are ranked by
            time to target; one per flag.
        strategies: without races, these specs (``;`` between them), ranked by step time.
        optimizer: their optimizer.
        speed: how many times faster than the profile's device the nodes compute.
        title: the map's title (default: one naming the workload and the ranking).
        nodes: the cluster sizes, comma-separated.
        rates: the link rates, comma-separated.
        out: the folder of ``map.md``, ``map.json`` and ``map.png``.
    """

    profile: Path = option(MISSING)
    races: tuple[Path, ...] = option(())
    strategies: str = option(
        "", "without races: these specs (';' between them), ranked by step time"
    )
    optimizer: str = option("sgd", "their optimizer (sgd, adamw, muon)")
    speed: float = option(1.0, "the nodes compute this many times faster than the profile's device")
    title: str | None = option(None, "the map's title")
    nodes: str = option("8,16,32,64")
    rates: str = option("1gbit,10gbit,25gbit,100gbit")
    out: Path = option(MISSING)


def run_parsed(cfg: ProfileConfig | ValidateConfig | MapConfig, call: suites.Call) -> int:
    """Run the subcommand `cfg` configures; ``validate`` exits with 1 when a check fails."""
    if isinstance(cfg, ProfileConfig):
        specs = [s for s in cfg.strategies.split(";") if s]
        prof = measure_profile(
            cfg.workload, specs, device=cfg.device, steps=cfg.steps, real=cfg.real
        )
        prof.save(cfg.out)
        print(f"wrote {cfg.out}")
        return 0
    if isinstance(cfg, ValidateConfig):
        profiles = {p.workload: p for p in map(Profile.load, cfg.profile)}
        host = 0.0
        if cfg.host_probe is not None:
            host = host_cost(json.loads(cfg.host_probe.read_text()))
        elif cfg.host_bps is not None:
            host = host_cost({"busbw_bps": [cfg.host_bps]})
        checks: list[Check] = []
        for path in cfg.results:
            recs = json.loads((path / "results.json").read_text())
            checks += validate(profiles, recs, source=str(path), host_s_per_byte=host)
        text = checks_markdown(checks)
        write_report(
            cfg.out,
            [{**asdict(c), "error": c.error, "ok": c.ok} for c in checks],
            title="The projection against the emulated cluster",
            command=call.command,
            body=text,
            indent=2,
        )
        print(text)
        return 0 if all(c.ok for c in checks) else 1
    assert isinstance(cfg, MapConfig)  # the third subcommand
    prof = Profile.load(cfg.profile)
    cands = race_candidates(
        [p / "results.json" if p.is_dir() else p for p in cfg.races], prof.workload
    )
    cands += [
        Candidate(spec=spec, optimizer=cfg.optimizer, steps=None, label=spec)
        for spec in cfg.strategies.split(";")
        if spec
    ]
    if not cands:
        raise SystemExit(
            f"no candidate: no race of {prof.workload} in {list(cfg.races)}, no --strategies"
        )
    cells = cluster_map(
        prof,
        cands,
        nodes=[int(n) for n in cfg.nodes.split(",")],
        rates=cfg.rates.split(","),
        speed=cfg.speed,
    )
    what = "first to the races' target" if any(c.steps for c in cands) else "fastest step"
    pace = f"{cfg.speed:g}x" if cfg.speed != 1 else "one"
    title = cfg.title or (
        f"{prof.workload}: {what}, projected (compute of {pace} {prof.device} process here)"
    )
    write_report(
        cfg.out,
        [asdict(c) for c in cells],
        title=title,
        command=call.command,
        body=map_markdown(cells, title=title, heading=False),
        plot=lambda path: plot_map(cells, path, title=title),
        indent=2,
        stem="map",
    )
    print(map_markdown(cells, title=title))
    return 0
