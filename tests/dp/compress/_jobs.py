"""Jobs run inside the shared worker processes of this package's tests (see conftest)."""

from __future__ import annotations

from typing import Any

import torch

import plait
from plait.comm import stats
from plait.trace import tracer
from tests.dp.compress._scenario import toy_model


def bytes_and_spans(rank: int, world: int) -> dict[str, Any]:
    """Collectives and trace spans of two ACP-SGD steps (a P-step, then a Q-step)."""
    tracer.enable()
    tracer.clear()
    ddp = plait.data_parallel(toy_model(), "acpsgd", rank=2, warmup=0)
    x = torch.randn(4, 3, 8, 8)
    records = []
    for _ in range(2):
        stats.reset()
        ddp(x).sum().backward()
        records.append([(r.op.value, r.nbytes) for r in stats.reset()])
    names = {e["name"].split(" ")[0] for e in tracer.events(rank) if e.get("ph") == "X"}
    tracer.enabled = False
    tracer.clear()
    return {"records": records, "spans": names}
