"""``python -m plait.bench.project profile|validate|map``: see `plait.bench.project`."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

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
from plait.records import write_json, write_markdown


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.project profile|validate|map ...`` (see --help)."""
    parser = argparse.ArgumentParser(prog="python -m plait.bench.project")
    sub = parser.add_subparsers(dest="action", required=True)
    pr = sub.add_parser("profile", help="measure a workload on this process")
    pr.add_argument("--workload", required=True)
    pr.add_argument("--strategies", default="", help="specs; ';' between them")
    pr.add_argument("--real", action="store_true", help="the training model (the races')")
    pr.add_argument("--device", default="cpu")
    pr.add_argument("--steps", type=int, default=5)
    pr.add_argument("--out", type=Path, required=True)
    va = sub.add_parser("validate", help="projection vs emulated `plait bench` results")
    va.add_argument("--profile", type=Path, action="append", required=True)
    va.add_argument("--results", type=Path, action="append", required=True)
    va.add_argument(
        "--host-probe",
        type=Path,
        default=None,
        help="an unshaped probe of the emulated cluster (JSON of plait cluster probe): "
        "the host's CPU cost per byte sent",
    )
    va.add_argument(
        "--host-bps",
        type=float,
        default=None,
        help="the same as a bus bandwidth in bit/s (the unshaped links' all-reduce rate)",
    )
    va.add_argument("--out", type=Path, required=True)
    ma = sub.add_parser("map", help="which strategy and optimizer wins where")
    ma.add_argument("--profile", type=Path, required=True)
    ma.add_argument("--races", type=Path, action="append", default=[])
    ma.add_argument(
        "--strategies",
        default="",
        help="without races: these specs (';' between them), ranked by step time",
    )
    ma.add_argument("--optimizer", default="sgd", help="their optimizer (sgd, adamw, muon)")
    ma.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="the nodes compute this many times faster than the profile's device",
    )
    ma.add_argument("--title", default=None, help="the map's title")
    ma.add_argument("--nodes", default="8,16,32,64")
    ma.add_argument("--rates", default="1gbit,10gbit,25gbit,100gbit")
    ma.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.action == "profile":
        specs = [s for s in args.strategies.split(";") if s]
        prof = measure_profile(
            args.workload, specs, device=args.device, steps=args.steps, real=args.real
        )
        prof.save(args.out)
        print(f"wrote {args.out}")
        return 0
    if args.action == "validate":
        profiles = {p.workload: p for p in map(Profile.load, args.profile)}
        host = 0.0
        if args.host_probe is not None:
            host = host_cost(json.loads(args.host_probe.read_text()))
        elif args.host_bps is not None:
            host = host_cost({"busbw_bps": [args.host_bps]})
        checks: list[Check] = []
        for path in args.results:
            recs = json.loads((path / "results.json").read_text())
            checks += validate(profiles, recs, source=str(path), host_s_per_byte=host)
        write_json(
            [{**asdict(c), "error": c.error, "ok": c.ok} for c in checks],
            args.out / "results.json",
            indent=2,
        )
        text = checks_markdown(checks)
        write_markdown(text, args.out / "results.md")
        print(text)
        return 0 if all(c.ok for c in checks) else 1
    prof = Profile.load(args.profile)
    cands = race_candidates(
        [p / "results.json" if p.is_dir() else p for p in args.races], prof.workload
    )
    cands += [
        Candidate(spec=spec, optimizer=args.optimizer, steps=None, label=spec)
        for spec in args.strategies.split(";")
        if spec
    ]
    if not cands:
        raise SystemExit(
            f"no candidate: no race of {prof.workload} in {args.races}, no --strategies"
        )
    cells = cluster_map(
        prof,
        cands,
        nodes=[int(n) for n in args.nodes.split(",")],
        rates=args.rates.split(","),
        speed=args.speed,
    )
    what = "first to the races' target" if any(c.steps for c in cands) else "fastest step"
    pace = f"{args.speed:g}x" if args.speed != 1 else "one"
    title = args.title or (
        f"{prof.workload}: {what}, projected (compute of {pace} {prof.device} process here)"
    )
    text = map_markdown(cells, title=title)
    write_markdown(text, args.out / "map.md")
    write_json([asdict(c) for c in cells], args.out / "map.json", indent=2)
    plot_map(cells, args.out / "map.png", title=title)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
