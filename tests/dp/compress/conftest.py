"""Shared worker processes: every distributed scenario of these tests runs in one spawn per
world size, because spawning and joining a gloo group costs more than the runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.testing import run_distributed
from tests.dp.compress._jobs import bytes_and_spans
from tests.dp.compress._scenario import DDPRun, Job, run_all

#: rank 2 on the toy model: every weight but the head's compresses
LOWRANK = {"rank": 2, "seed": 3}
#: ACP-SGD from its first step (its default warms up 2 dense steps; a job of its own tests
#: that), so the scenario's few steps all exercise the compressed path
ACP = {**LOWRANK, "warmup": 0}

WORLD2: dict[str, Job] = {
    "acpsgd": DDPRun(compression="acpsgd", options=ACP),
    "acpsgd-resume": DDPRun(compression="acpsgd", options=ACP, resume_at=3),
    "acpsgd-warmup-unused": DDPRun(
        compression="acpsgd", options={"rank": 2, "warmup": 2}, unused=True
    ),
    "acpsgd-fp16": DDPRun(compression="acpsgd", options=ACP, dtype=torch.float16),
    "acpsgd-bf16": DDPRun(compression="acpsgd", options=ACP, dtype=torch.bfloat16),
    "acpsgd-bytes": bytes_and_spans,
    "powersgd": DDPRun(compression="powersgd", options=LOWRANK),
    "powersgd-resume": DDPRun(compression="powersgd", options=LOWRANK, resume_at=3),
    "powersgd-unused": DDPRun(compression="powersgd", options=LOWRANK, unused=True),
    "torch-powersgd": DDPRun(compression="torch-powersgd", options={"rank": 2}),
    "torch-powersgd-resume": DDPRun(compression="torch-powersgd", options={"rank": 2}, resume_at=4),
    "signsgd": DDPRun(compression="signsgd"),
    "signsgd-resume": DDPRun(compression="signsgd", resume_at=3),
    "topk": DDPRun(compression="topk", options={"ratio": 0.2}, bucket_cap_mb=25.0),
    "topk-resume": DDPRun(
        compression="topk", options={"ratio": 0.2}, bucket_cap_mb=25.0, resume_at=3
    ),
    "fp16": DDPRun(compression="fp16"),
    "bf16": DDPRun(compression="bf16"),
}

#: several buckets (small caps) on 4 ranks: the gloo ordering of the two-all-reduce pipeline
WORLD4: dict[str, Job] = {
    "acpsgd": DDPRun(compression="acpsgd", options=ACP, bucket_cap_mb=0.004),
    "powersgd": DDPRun(compression="powersgd", options=LOWRANK, bucket_cap_mb=0.004),
    "signsgd": DDPRun(compression="signsgd", bucket_cap_mb=0.004),
}

WORLD1: dict[str, Job] = {
    "acpsgd": DDPRun(compression="acpsgd", options=ACP, bucket_cap_mb=25.0),
    "powersgd": DDPRun(compression="powersgd", options=LOWRANK),
    "torch-powersgd": DDPRun(compression="torch-powersgd", options={"rank": 2}),
    "signsgd": DDPRun(compression="signsgd"),
    "topk": DDPRun(compression="topk", options={"ratio": 0.2}, bucket_cap_mb=25.0),
    "fp16": DDPRun(compression="fp16"),
}


def _run(jobs: dict[str, Job], world: int) -> list[dict[str, Any]]:
    return run_distributed(run_all, jobs, world_size=world, timeout_s=600)


@pytest.fixture(scope="session")
def world1() -> list[dict[str, Any]]:
    return _run(WORLD1, 1)


@pytest.fixture(scope="session")
def world2() -> list[dict[str, Any]]:
    return _run(WORLD2, 2)


@pytest.fixture(scope="session")
def world4() -> list[dict[str, Any]]:
    return _run(WORLD4, 4)
