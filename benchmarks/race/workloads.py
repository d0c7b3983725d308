"""Workloads of the slow-link races, as user factories (``--workload FILE:FACTORY``).

`gpt_link`: the character GPT of the `gpt` workload (4 layers x 256, 3.2 M parameters,
the pydoc text) at 2 sequences of 128 characters per worker, for both training and
`plait bench`. A smaller batch is fewer FLOPs for the same gradient bytes: at `slow`
(100 Mbit/s) on 4 nodes, S-SGD's step is then 1.93 s against 0.24 s of compute, 87%
communication (`plait bench --workload benchmarks/race/workloads.py:gpt_link
--strategies ssgd --nodes 4 --bandwidth slow`), the regime of the papers' GPU clusters on
1 GbE, where the 16 sequences of the `gpt` workload leave 63%.
"""

from __future__ import annotations

from dataclasses import replace

from plait.workloads import Workload, get_workload

#: sequences per worker (see the module docstring)
BATCH = 2


def gpt_link() -> Workload:
    """The `gpt` workload at 2 sequences per worker, benchmarked as trained."""
    gpt = get_workload("gpt")
    return replace(
        gpt,
        name="gpt-link",
        description="character GPT 4x256 on pydoc text, 2 sequences of 128 per worker",
        bench_build=None,
        synthetic=None,
        bench_batch=BATCH,
        train_batch=BATCH,
    )
