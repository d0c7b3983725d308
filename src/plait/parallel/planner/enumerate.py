"""Enumeration: every plan a world size and a model admit.

Splits of the world into pipeline x data x tensor degrees the model's shape allows (a
tensor degree must divide heads and widths), ZeRO stages, sequence parallelism, pipeline
schedules and micro-batch counts, activation checkpointing, and offload where host memory
is separate. Nothing is priced here: `plait.parallel.planner.price` does that.
"""

from __future__ import annotations

from collections.abc import Iterator

from plait.parallel.adapters import ModelDims
from plait.parallel.plan import Plan, Schedule, ZeroStage


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_plans(
    world: int, dims: ModelDims, *, global_batch: int, host_offload: bool = False
) -> Iterator[Plan]:
    """Every valid plan for this world and model (see the module docstring).

    A plan is skipped when its data degree does not divide `global_batch` (ranks would
    read unequal shards), a pipeline has more stages than the model has blocks or cannot
    split it (`ModelDims.no_pipeline`), or sequence parallelism cannot shard its norms.
    """
    for tp in _divisors(world):
        try:
            dims.check_tensor_degree(tp)
        except ValueError:
            continue
        for pp in _divisors(world // tp):
            if pp > 1 and (dims.layers < pp or dims.layers == 0 or dims.no_pipeline):
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            local = global_batch // dp
            zeros = [ZeroStage.NONE]
            if dp > 1:
                zeros += [ZeroStage.GRADIENTS, ZeroStage.PARAMETERS]
                if tp == 1:
                    zeros.insert(1, ZeroStage.OPTIMIZER)
            sps = (
                [False, True]
                if tp > 1 and not dims.no_sequence and (not dims.seq_len or dims.seq_len % tp == 0)
                else [False]
            )
            schedules = [Schedule.ONE_F_ONE_B]
            if pp > 1:
                schedules = [Schedule.GPIPE, Schedule.ONE_F_ONE_B]
                if dims.layers >= 2 * pp:
                    schedules += [Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE]
            for zero in zeros:
                offloads = (
                    [False, True] if host_offload and zero >= ZeroStage.GRADIENTS else [False]
                )
                for sp in sps:
                    for schedule in schedules:
                        if schedule is Schedule.ZERO_BUBBLE and (
                            zero is ZeroStage.PARAMETERS or sp
                        ):
                            continue
                        mbs: list[int | None] = [None]
                        if pp > 1:
                            mbs = [m for m in (pp, 2 * pp, 4 * pp) if m <= local and local % m == 0]
                        for m in mbs:
                            # checkpointing adds memory under zero-bubble (Plan.validate)
                            acs = [False] if schedule is Schedule.ZERO_BUBBLE else [False, True]
                            for ac in acs:
                                for off in offloads:
                                    yield Plan(
                                        dp=dp,
                                        tp=tp,
                                        pp=pp,
                                        zero=zero,
                                        sp=sp,
                                        schedule=schedule,
                                        microbatches=m,
                                        ac=ac,
                                        offload=off,
                                    )


def excluded_degrees(world: int, dims: ModelDims) -> list[str]:
    """Why the tensor degrees the world would allow but the model does not are absent."""
    out = []
    for tp in _divisors(world)[1:]:
        try:
            dims.check_tensor_degree(tp)
        except ValueError as e:
            out.append(f"tp={tp} excluded ({str(e).removeprefix('plan: ')})")
    return out
