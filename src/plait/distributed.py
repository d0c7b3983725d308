"""Process-group set-up shared by the training loop, the benchmarks and the tests.

Under torchrun (or any launcher that sets RANK/WORLD_SIZE) it initialises the default
group: NCCL when the process has a GPU, gloo otherwise, always with a timeout so that a
missing peer fails the job instead of hanging it. Without those variables the process is
a world of one and no group is created.

Every group plait creates after that (K-FAC's blocks, Power-SGD's private group, the
crossover models' groups, the parallel mesh's axes) goes through `new_group`, which gives
it the default group's timeout: torch would give subgroups its own 30-minute default, so a
stopped peer would hang a K-FAC or Power-SGD step for half an hour instead of failing it.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

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


def collective_timeout(group: Any = None) -> datetime.timedelta:
    """The timeout `group`'s collectives wait for their peers (default: the default group's).

    Read from the group's backend, so it is the timeout the group was really created with
    (by `init_distributed`, a test harness or the user's own ``init_process_group``);
    PLAIT_TIMEOUT when the group does not say or none is initialised.
    """
    fallback = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    if not dist.is_initialized():
        return fallback
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for dev in ("cuda", "cpu"):
        try:
            timeout = pg._get_backend(torch.device(dev)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    return fallback


def new_group(ranks: Sequence[int] | None = None, **kwargs: Any) -> Any:
    """``dist.new_group(ranks)`` with the default group's timeout (see `collective_timeout`),
    kept until exit (`retain_group`).

    Collective over the default group unless ``use_local_synchronization=True``: every
    rank must create the same groups in the same order.

    Args:
        ranks: global ranks of the group (None: all).
        **kwargs: passed to `torch.distributed.new_group`; ``timeout`` overrides plait's.
    """
    kwargs.setdefault("timeout", collective_timeout())
    group = dist.new_group(ranks=list(ranks) if ranks is not None else None, **kwargs)
    retain_group(group)  # its owner may die under the GIL at exit: see `retain_group`
    return group


def mesh_backend_options(ndim: int) -> dict[int | str, Any]:
    """`init_device_mesh`'s ``backend_override`` giving every axis group plait's timeout.

    A device mesh creates one group per axis slice with torch's default timeout unless its
    backend options carry one; these options carry `collective_timeout`.
    """
    timeout = collective_timeout()
    backend = str(dist.get_backend()) if dist.is_initialized() else "gloo"
    out: dict[int | str, Any] = {}
    for dim in range(ndim):
        opts: Any
        if "nccl" in backend:
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
        else:
            opts = torch._C._distributed_c10d.Backend.Options(backend, timeout)
        opts._timeout = timeout
        out[dim] = opts  # the default group's backend, these options
    return out


#: Process groups kept alive until the interpreter exits (see `retain_group`), by id.
_RETAINED: dict[int, Any] = {}


def retain_group(group: Any = None) -> None:
    """Keep `group` (None: the default group) alive until the interpreter exits.

    A DDP wrapper's reducer holds a reference to its process group. When the user destroys
    the group first (``destroy_process_group()``, then the model goes out of scope, as
    PyTorch's own DDP tutorial orders it), the reducer's destructor drops the group's last
    reference while holding the GIL; gloo's destructor then joins its worker threads, and
    a worker still releasing a Python callback of the last step waits for the GIL
    forever. Measured here: a 4-process torchrun job with ACP-SGD hung at exit in 3 of 3
    runs that way, and in 0 of 4 with the group retained. With the group retained, the
    reducer is never its last owner; the group goes when the interpreter tears down, long
    after any callback has finished. `plait.data_parallel` and every compressor's hook
    call it, so no plait wrapper can hang a finished job at exit.
    """
    if group is None:
        if not dist.is_initialized():
            return
        group = dist.distributed_c10d._get_default_group()
    _RETAINED.setdefault(id(group), group)


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
