"""Process-group set-up shared by the training loop, the benchmarks and the tests.

Under torchrun (or any launcher that sets RANK/WORLD_SIZE) it initialises the default
group, always with a timeout so that a missing peer fails the job instead of hanging it.
Without those variables the process is a world of one and no group is created.

Which device a rank computes on and which backend carries its collectives follow from
`gpu_placement`: on the CPU, gloo; on CUDA with a GPU per rank of the host, NCCL (gloo
beside it for the CPU tensors some bookkeeping all-reduces); on CUDA with more ranks than
GPUs (the emulated nodes of `plait run --nodes 4 --device cuda` on one GPU), the ranks
share the GPUs round-robin and talk through gloo, which all-reduces, broadcasts and
gathers CUDA tensors by way of pinned host memory (NCCL refuses two ranks on one GPU).
The device is chosen by ``PLAIT_DEVICE`` (``cpu`` or ``cuda``, set by plait's launcher
from ``--device``), else CUDA when the process sees a GPU.

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Seconds a collective may wait for its peers before the job fails (PLAIT_TIMEOUT).
DEFAULT_TIMEOUT_S = float(os.environ.get("PLAIT_TIMEOUT", "300"))


#: Environment variable naming the device kind of a job's ranks (``cpu`` or ``cuda``).
DEVICE_ENV = "PLAIT_DEVICE"

#: The device this process computes on, once `init_distributed` chose it (one item).
_chosen: list[torch.device] = []


@dataclass(frozen=True)
class Placement:
    """Where one rank computes and how its collectives travel.

    Attributes:
        backend: the default group's backend, as ``init_process_group`` takes it
            (``gloo``, or ``cpu:gloo,cuda:nccl``).
        device: the rank's device (``cpu`` or ``cuda:N``).
        shared: True when several ranks of the host compute on this GPU.
    """

    backend: str
    device: str
    shared: bool = False

    @property
    def nccl(self) -> bool:
        return "nccl" in self.backend


def device_kind() -> str:
    """``cuda`` or ``cpu``: ``PLAIT_DEVICE`` when set, else CUDA when a GPU is visible.

    Raises:
        ValueError: ``PLAIT_DEVICE`` names another kind, or ``cuda`` without a GPU.
    """
    kind = os.environ.get(DEVICE_ENV, "").strip().lower()
    if not kind:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={kind!r}: expected cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{DEVICE_ENV}=cuda but this process sees no CUDA device")
    return kind


def gpu_placement(kind: str, *, host_ranks: int, host_index: int, gpus: int) -> Placement:
    """The backend and device of rank `host_index` of the `host_ranks` ranks on one host.

    Pure, so the decision is tested without a GPU. NCCL needs a GPU of its own per rank
    (it refuses two ranks on one device); with fewer GPUs than ranks the ranks share them
    round-robin and gloo carries every collective, CUDA tensors included.

    Args:
        kind: ``cpu`` or ``cuda``.
        host_ranks: ranks on this host (every emulated node's ranks: they share one host).
        host_index: this rank's index among them.
        gpus: CUDA devices this host shows.

    Raises:
        ValueError: a bad kind or index, or ``cuda`` with no GPU.
    """
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device kind must be cpu or cuda, got {kind!r}")
    if host_ranks < 1 or not 0 <= host_index < host_ranks:
        raise ValueError(f"rank {host_index} of {host_ranks} on the host is not a rank")
    if kind == "cpu":
        return Placement(backend="gloo", device="cpu")
    if gpus < 1:
        raise ValueError("device cuda requested, but the host has no CUDA device")
    if host_ranks <= gpus:
        return Placement(backend="cpu:gloo,cuda:nccl", device=f"cuda:{host_index}")
    return Placement(backend="gloo", device=f"cuda:{host_index % gpus}", shared=True)


def host_ranks() -> tuple[int, int]:
    """(ranks on this host, this rank's index among them), from the launcher's variables.

    The emulated cluster's nodes (``PLAIT_NODES``, ``PLAIT_NODE``) all live on this host;
    elsewhere torchrun's ``LOCAL_WORLD_SIZE`` and ``LOCAL_RANK`` count the host's ranks.
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = os.environ.get("PLAIT_NODES")
    if nodes:
        node = int(os.environ.get("PLAIT_NODE", "0"))
        return int(nodes) * per_node, node * per_node + local
    return per_node, local


def current_placement() -> Placement:
    """This process's `Placement` under its launcher's variables and visible GPUs."""
    kind = device_kind()
    n, index = host_ranks()
    gpus = torch.cuda.device_count() if kind == "cuda" else 0
    return gpu_placement(kind, host_ranks=n, host_index=index, gpus=gpus)


def init_distributed(*, timeout_s: float | None = None, backend: str | None = None) -> int:
    """Initialise the default process group if launched distributed; return the world size.

    The backend and this rank's device come from `current_placement` unless `backend`
    is given (then the device follows it: CUDA for ``nccl``).
    """
    if dist.is_initialized():
        return dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 1
    place = current_placement()
    if backend is not None and backend != place.backend:
        cuda = "nccl" in backend
        place = Placement(backend=backend, device=place.device if cuda else "cpu")
    if place.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(place.device))
    _chosen[:] = [torch.device(place.device)]
    if place.shared:
        logger.info(
            "rank %s computes on %s, shared with other ranks of this host; collectives "
            "through gloo",
            os.environ.get("RANK"),
            place.device,
        )
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    dist.init_process_group(backend=place.backend, timeout=timeout)
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
    if "," in backend:  # gloo and NCCL side by side: one options object cannot serve both
        return out
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


def device() -> torch.device:
    """The device this rank computes on.

    The one `init_distributed` chose; in a group initialised elsewhere (a test harness, a
    user's own ``init_process_group``), CUDA's current device under NCCL or when
    ``PLAIT_DEVICE=cuda``, else the CPU.
    """
    if _chosen and dist.is_initialized():
        return _chosen[0]
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    if os.environ.get(DEVICE_ENV, "").strip().lower() == "cuda" and torch.cuda.is_available():
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
    _chosen.clear()
    gc.collect()
