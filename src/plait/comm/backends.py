"""Which collectives a backend carries on which device, checked before anything launches.

Ranks that share one GPU (emulated nodes on a one-GPU machine) cannot use NCCL, which
refuses two ranks on one device, so they talk through gloo. Gloo's CUDA support is
partial: its all-reduce, broadcast, all-gather, gather, scatter, reduce and all-to-all
copy CUDA tensors to pinned host memory, run on the host and copy back, and its
reduce-scatter is an all-reduce of the whole buffer followed by a local slice; but its
point-to-point send and receive hand the tensor's device pointer to the host transport,
and its coalesced all-reduce accepts CPU tensors only. Pipeline stages exchange
activations by send and receive, so a pipeline plan cannot run on ranks sharing a GPU.
These facts come from ProcessGroupGloo's sources (torch 2.x); `unsupported` applies them.
"""

from __future__ import annotations

from collections.abc import Iterable

from plait.comm.stats import Collective

#: Collectives gloo runs on CUDA tensors (by way of pinned host copies).
GLOO_CUDA: frozenset[Collective] = frozenset(
    {
        Collective.ALL_REDUCE,
        Collective.ALL_GATHER,
        Collective.REDUCE_SCATTER,
        Collective.BROADCAST,
        Collective.ALL_TO_ALL,
        Collective.BARRIER,
    }
)

#: Why gloo cannot run the others on CUDA, for the error message.
_WHY = {
    Collective.SEND: "gloo's send and receive take host memory only (pipeline stages use them)",
}


def unsupported(needs: Iterable[Collective], *, backend: str, device: str) -> list[Collective]:
    """The collectives of `needs` that `backend` cannot run on tensors of `device`.

    Args:
        needs: collectives a strategy issues.
        backend: the default group's backend (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``).
        device: ``cpu`` or ``cuda[:N]``.
    """
    if not device.startswith("cuda") or "nccl" in backend:
        return []
    return sorted({op for op in needs if op not in GLOO_CUDA}, key=str)


def check_collectives(
    owner: str, needs: Iterable[Collective], *, backend: str, device: str
) -> None:
    """Refuse `owner` (a strategy) when its collectives cannot run on `backend` and `device`.

    Raises:
        ValueError: naming the owner, each collective gloo cannot run on CUDA and why, and
            what to do instead.
    """
    missing = unsupported(needs, backend=backend, device=device)
    if not missing:
        return
    what = "; ".join(f"{op}: {_WHY.get(op, 'not implemented for CUDA tensors')}" for op in missing)
    raise ValueError(
        f"{owner} needs collectives that gloo cannot run on CUDA tensors ({what}); ranks "
        "that share a GPU talk through gloo: give every rank a GPU of its own (NCCL), "
        "choose a strategy without them, or use --device cpu"
    )
