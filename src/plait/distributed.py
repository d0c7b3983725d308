"""Process-group set-up shared by the training loop, the benchmarks and the tests.

Under torchrun (or any launcher that sets RANK/WORLD_SIZE) it initialises the default
group: NCCL when the process has a GPU, gloo otherwise, always with a timeout so that a
missing peer fails the job instead of hanging it. Without those variables the process is
a world of one and no group is created.
"""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist

#: Seconds a collective may wait for its peers before the job fails (PLAIT_TIMEOUT).
DEFAULT_TIMEOUT_S = float(os.environ.get("PLAIT_TIMEOUT", "300"))


def init_distributed(*, timeout_s: float | None = None, backend: str | None = None) -> int:
    """Initialise the default process group if launched distributed; return the world size."""
    if dist.is_initialized():
        return dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 1
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_world_size()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown() -> None:
    """Destroy every process group while the interpreter is still whole.

    DDP's reducer, compressors and K-FAC hold shared references to their groups and often
    sit in reference cycles (hooks and futures point back at their owners) that only the
    garbage collector frees. Left to interpreter exit, such a cycle can outlive
    `destroy_process_group` and take a gloo group's worker threads down during
    finalisation, which aborts the process after the work has finished. Collecting first
    releases those references, so destroying the groups really joins their threads.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
