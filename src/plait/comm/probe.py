"""Measure collective performance on the live process group and fit the alpha-beta model.

Run inside a distributed job (every rank calls it). Used by `plait cluster probe` and at
the start of every benchmark job, so that each result carries the network it ran on.
The all-reduces go through `plait.comm.ops` on the rank's device, so a modelled link
(`plait.comm.link`) is probed as the job's collectives will meet it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plait import distributed as pdist
from plait.comm import ops
from plait.comm.cost import AlphaBeta, CollectiveCosts
from plait.comm.stats import Collective, wire_bytes

DEFAULT_SIZES = (16 * 1024, 256 * 1024, 2 * 1024 * 1024)


@dataclass(kw_only=True)
class ProbeResult:
    """Median all-reduce time per payload size, the fitted model, and the bus bandwidth.

    Bus bandwidth is the rate at which each worker sends under a ring all-reduce,
    ``2 (p-1)/p * bytes / time`` (as nccl-tests define it): it approaches the link rate
    for large messages and is directly comparable with the configured tc rate.
    """

    world: int
    sizes: list[int]
    seconds: list[float]
    model: AlphaBeta
    busbw_bps: list[float] = field(default_factory=list)

    @property
    def peak_busbw_bps(self) -> float:
        return max(self.busbw_bps) if self.busbw_bps else float("nan")

    def table(self) -> str:
        rows = [f"{'bytes':>12} {'time ms':>10} {'busbw Mbit/s':>13}"]
        for n, t, bw in zip(self.sizes, self.seconds, self.busbw_bps, strict=True):
            rows.append(f"{n:>12d} {1000 * t:>10.2f} {bw / 1e6:>13.1f}")
        return "\n".join(rows)

    def to_dict(self) -> dict[str, object]:
        return {
            "world": self.world,
            "sizes": self.sizes,
            "seconds": self.seconds,
            "busbw_bps": self.busbw_bps,
            "alpha_s": self.model.alpha,
            "beta_s_per_byte": self.model.beta,
            "bandwidth_bps": self.model.bandwidth_bps,
        }


def probe_allreduce(
    *, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 3, group: Any = None
) -> ProbeResult:
    """Time all-reduces of float32 buffers of `sizes` bytes; collective, call on every rank."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world < 2:
        raise ValueError("probing the network needs at least two workers")
    samples: list[tuple[Collective, int, int, float]] = []
    medians: list[float] = []
    device = pdist.device()
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4), device=device)
        ops.all_reduce(buf, group=group, name="probe", async_op=False)  # connect, warm up
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            ops.all_reduce(buf, group=group, name="probe", async_op=False)
            if buf.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        # the slowest rank defines the collective's time
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        med = statistics.median(t.tolist())
        medians.append(med)
        samples += [(Collective.ALL_REDUCE, buf.numel() * 4, world, s) for s in t.tolist()]
    model = AlphaBeta.fit(samples)
    busbw = [
        8 * wire_bytes(Collective.ALL_REDUCE, n, world) / t
        for n, t in zip(sizes, medians, strict=True)
    ]
    return ProbeResult(
        world=world, sizes=list(sizes), seconds=medians, model=model, busbw_bps=busbw
    )


def _issue(op: Collective, buf: torch.Tensor, world: int, group: Any) -> None:
    if op is Collective.ALL_REDUCE:
        ops.all_reduce(buf, group=group, name="probe", async_op=False)
    elif op is Collective.ALL_GATHER:
        ops.all_gather(buf, group=group, name="probe", async_op=False)
    elif op is Collective.REDUCE_SCATTER:
        ops.reduce_scatter(buf, group=group, name="probe", async_op=False)
    elif op is Collective.BROADCAST:
        src = dist.get_global_rank(group, 0) if group else 0
        ops.broadcast(buf, src=src, group=group, name="probe", async_op=False)
    else:
        raise ValueError(f"cannot probe {op}")
    if buf.is_cuda:
        torch.cuda.synchronize()


def probe_collectives(
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    ops: Sequence[Collective] = (
        Collective.ALL_REDUCE,
        Collective.ALL_GATHER,
        Collective.REDUCE_SCATTER,
        Collective.BROADCAST,
    ),
    repeats: int = 3,
    group: Any = None,
) -> CollectiveCosts:
    """Fit an alpha-beta model per collective kind on the live group (collective).

    Payloads are the bytes each worker hands in (its shard for all-gather), so each kind
    is fitted against its own ring wire-bytes formula and the fit shows how far the
    backend's implementation is from it. All-reduce is the default for other kinds.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world < 2:
        raise ValueError("probing the network needs at least two workers")
    fitted: dict[Collective, AlphaBeta] = {}
    for op in ops:
        samples: list[tuple[Collective, int, int, float]] = []
        for nbytes in sizes:
            n = max(world, nbytes // 4 // world * world)  # divisible for reduce-scatter
            if op is Collective.ALL_GATHER:
                n //= world
            buf = torch.ones(n, device=pdist.device())
            _issue(op, buf, world, group)  # connect and warm up
            times = []
            for _ in range(repeats):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                _issue(op, buf, world, group)
                times.append(time.perf_counter() - t0)
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            samples += [(op, n * 4, world, s) for s in t.tolist()]
        fitted[op] = AlphaBeta.fit(samples)
    default = fitted.get(Collective.ALL_REDUCE) or next(iter(fitted.values()))
    return CollectiveCosts(default=default, per_op=fitted)


def format_probe(res: dict[str, Any], rate_bps: float | None) -> str:
    """A probe's JSON result (`main`'s output) as a table, against the configured rate."""
    lines = [f"{'bytes':>12} {'time ms':>10} {'bus bw Mbit/s':>14}"]
    for n, t, bw in zip(res["sizes"], res["seconds"], res["busbw_bps"], strict=True):
        lines.append(f"{n:>12d} {1000 * t:>10.2f} {bw / 1e6:>14.1f}")
    lines.append(
        f"alpha-beta fit: alpha = {1e6 * res['alpha_s']:.1f} us per message, "
        f"beta = {1e9 * res['beta_s_per_byte']:.3f} ns/byte "
        f"(= {res['bandwidth_bps'] / 1e6:.1f} Mbit/s)"
    )
    if rate_bps:
        big = res["busbw_bps"][-1]  # small messages ride the token bucket's burst
        lines.append(
            f"configured rate {rate_bps / 1e6:.1f} Mbit/s; bus bandwidth at {res['sizes'][-1]} "
            f"bytes {big / 1e6:.1f} Mbit/s ({100 * big / rate_bps:.0f}%)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Worker entry point of `plait cluster probe`: ``python -m plait.comm.probe OUT.json``."""
    import json
    import sys
    from pathlib import Path

    from plait import distributed as pdist

    args = sys.argv[1:] if argv is None else argv
    pdist.init_distributed()
    try:
        sizes = (64 * 1024, 1024 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)
        result = probe_allreduce(sizes=sizes, repeats=3)
        out = result.to_dict()
        if "--collectives" in args:  # one alpha-beta model per collective kind
            out["collectives"] = probe_collectives(sizes=sizes[:3]).to_dict()
        paths = [a for a in args if not a.startswith("--")]
        if pdist.is_main() and paths:
            Path(paths[0]).write_text(json.dumps(out, indent=2))
    finally:
        pdist.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
