"""Counted, traced collectives: the only way plait code talks to torch.distributed.

Each call records its bytes in `plait.comm.stats` and, when tracing, a span from issue to
completion on a "comm" track. Asynchronous calls return a `torch.futures.Future` (the type
DDP comm hooks return), resolved with the output tensor.

On gloo every collective must be issued in the same order on every rank. Issue them from
one thread (a DDP hook runs on the autograd thread in bucket order) or through a
`CollectiveQueue`; never from a future's callback, which runs on whichever thread completes
the previous collective.

A collective that fails (a peer died, stopped past the group's timeout, or issued a
different collective) never yields its local, un-averaged input: its future carries a
`CollectiveError` naming the collective, the group and, where the transport says which,
the lost peer, so every rank waiting on it raises instead of training on alone.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from plait.comm import link as _link
from plait.comm.stats import Collective, stats
from plait.trace import COMM, profiled, tracer

Group = Any  # dist.ProcessGroup | None: None means the default group

logger = logging.getLogger(__name__)

_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
_PEER_RANK = re.compile(r"\b(?:peer|remote|source|src)?\s*rank[ :=]+(\d+)", re.IGNORECASE)
_LOST = ("reset by peer", "closed by peer", "broken pipe", "connection refused", "eof")
_TORCH_CALLBACK = "Got the following error when running the callback: "


class CollectiveError(RuntimeError):
    """A collective failed on this rank: its result must not be used.

    The message names the collective, this rank, the group's ranks and the cause (the
    lost peer where the transport says which). It travels through torch futures as text:
    a future's callback chain and DDP re-raise it as a RuntimeError whose message contains
    ``CollectiveError: ...``; `wait` turns such an error back into a `CollectiveError`.

    Attributes:
        collective: the traced name of the collective (``"allreduce b3"``).
        ranks: global ranks of the group.
        peer: global rank of the lost peer when known, else None.
    """

    def __init__(
        self,
        message: str,
        *,
        collective: str = "",
        ranks: tuple[int, ...] = (),
        peer: int | None = None,
    ) -> None:
        super().__init__(message)
        self.collective = collective
        self.ranks = ranks
        self.peer = peer


def _group_ranks(group: Group) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    except (RuntimeError, ValueError):  # destroyed or unknown group: name what we can
        return ()


def collective_error(
    op: Collective | str, name: str, group: Group, cause: BaseException
) -> CollectiveError:
    """Describe the failure `cause` of collective `name` (`op`) on `group`.

    The peer is named when the transport's message gives its rank, or when the group has
    exactly one other member; otherwise the message keeps the peer's address as given.
    """
    if isinstance(cause, CollectiveError):
        return cause
    text = str(cause).strip()
    while True:  # each torch future callback in the chain prefixed the text once more
        stripped = text.removeprefix("RuntimeError: ").removeprefix(_TORCH_CALLBACK)
        if stripped == text:
            break
        text = stripped
    first = text.split("\n\nAt:")[0].strip()
    ranks = _group_ranks(group)
    me = dist.get_rank() if dist.is_initialized() else 0
    peer: int | None = None
    found = _PEER_RANK.search(first)
    if found is not None and int(found.group(1)) in ranks and int(found.group(1)) != me:
        peer = int(found.group(1))
    elif len(ranks) == 2 and me in ranks:
        peer = ranks[0] if ranks[1] == me else ranks[1]
    lowered = first.lower()
    if "timed out" in lowered or "timeout" in lowered:
        what = "did not answer within the group's timeout (stopped, hung or too slow)"
    elif any(k in lowered for k in _LOST):
        what = "lost (its process died or its connection closed)"
    else:
        what = "failed"
    addr = _ADDRESS.search(first)
    where = f" ([{addr.group(1)}]:{addr.group(2)})" if addr else ""
    who = f"peer rank {peer}{where}" if peer is not None else f"a peer{where}"
    op_name = op.value if isinstance(op, Collective) else str(op)
    message = (
        f"collective {name!r} ({op_name}) failed on rank {me} in the group of ranks "
        f"{list(ranks)} (size {len(ranks)}): {who} {what}; cause: {first}"
    )
    err = CollectiveError(message, collective=name, ranks=ranks, peer=peer)
    _RECENT[message] = err
    while len(_RECENT) > _RECENT_MAX:
        del _RECENT[next(iter(_RECENT))]
    return err


#: The last errors `collective_error` made, by message: a future carries an error as text
#: only, and `wait` gives back the error itself (its collective, ranks and peer).
_RECENT: dict[str, CollectiveError] = {}
_RECENT_MAX = 64


def wait(fut: torch.futures.Future[Any]) -> Any:
    """``fut.wait()``, re-raising a failed collective as a `CollectiveError`.

    Torch futures carry errors as text, so an error raised in a callback comes back as a
    RuntimeError; this recovers the `CollectiveError` it started as.
    """
    try:
        return fut.wait()
    except CollectiveError:
        raise
    except RuntimeError as exc:
        _reraise(exc)


def _reraise(exc: RuntimeError) -> NoReturn:
    text = str(exc)
    tag = "CollectiveError: "
    at = text.find(tag)
    if at < 0:
        raise exc
    message = text[at + len(tag) :].split("\n\nAt:", maxsplit=1)[0].strip()
    known = _RECENT.get(message)
    if known is not None:
        raise CollectiveError(
            message, collective=known.collective, ranks=known.ranks, peer=known.peer
        ) from exc
    raise CollectiveError(message) from exc


#: Text of a transport's failure (gloo, NCCL, the TCP store) in a RuntimeError that torch's
#: own collectives raise (DTensor's, pipelining's, DDP's internal broadcasts).
_TRANSPORT = (
    "gloo",
    "nccl",
    "connection closed by peer",
    "connection reset by peer",
    "timed out waiting",
    "pair closure",
    "broken pipe",
    "socket timeout",
)


@contextlib.contextmanager
def collective_errors(name: str, group: Group = None) -> Iterator[None]:
    """Raise a collective failing inside the block as a `CollectiveError`, whoever issued it.

    Collectives issued through this module already fail so; torch's own (DTensor's,
    pipelining's, DDP's) raise a RuntimeError with the transport's text, and a hook's
    failure comes back from DDP as a RuntimeError holding the `CollectiveError`'s text.
    Both become the class here, so ``except CollectiveError`` catches every lost peer.
    Other errors pass through unchanged.

    Args:
        name: what the block does (``"step"``), named in the error.
        group: the group the block communicates in (None: the default group).
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        if "CollectiveError: " in str(exc):
            _reraise(exc)
        lowered = str(exc).lower()
        if any(k in lowered for k in _TRANSPORT):
            raise collective_error("torch collective", name, group, exc) from exc
        raise


# torch 2.13 renamed the flat-tensor collectives; keep both spellings working
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_size(group: Group = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _done_future(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _issue(
    op: Collective,
    tensor: torch.Tensor,
    out: torch.Tensor,
    launch: Any,
    *,
    group: Group,
    name: str,
    async_op: bool,
) -> torch.futures.Future[torch.Tensor]:
    """Count `op` on `tensor`'s bytes, run ``launch()`` (the async torch call), and return a
    future of `out` that closes the trace span when the work finishes.

    Under a modelled link (`plait.comm.link`) the work is booked on the link first and its
    future completes no earlier than the link's transfer would end.
    """
    nbytes = tensor.numel() * tensor.element_size()
    world = world_size(group)
    stats.add(op, nbytes, world)
    link = _link.current()
    ends_at = None if link is None else link.reserve(op, nbytes, world, issued_at=link.clock())
    start = tracer.now_us()
    try:
        with profiled(name):  # the span itself ends in `finish`, after the issue
            work = launch()
        try:
            fut: torch.futures.Future[Any] = work.get_future()
        except RuntimeError:  # some gloo works (reduce_scatter) have no future: wait here
            work.wait()
            fut = _done_future(out)
    except RuntimeError as exc:
        err = collective_error(op, name, group, exc)
        logger.debug("%s", err)
        raise err from exc
    if link is not None and ends_at is not None:
        fut = link.delay(fut, ends_at=ends_at, device=tensor.device)

    def finish(done: torch.futures.Future[Any]) -> torch.Tensor:
        tracer.add(name, COMM, start, tracer.now_us(), thread="comm", args={"bytes": nbytes})
        try:
            done.value()  # raises if the collective failed: never hand back `out` then
        except Exception as exc:
            err = collective_error(op, name, group, exc)
            logger.debug("%s", err)
            raise err from exc
        return out

    result = fut.then(finish)
    if not async_op:
        wait(result)
    return result


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: Group = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    name: str = "all_reduce",
    async_op: bool = True,
) -> torch.futures.Future[torch.Tensor]:
    """In-place all-reduce of `tensor`; the future yields `tensor`."""
    if world_size(group) == 1:
        return _done_future(tensor)
    return _issue(
        Collective.ALL_REDUCE,
        tensor,
        tensor,
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        group=group,
        name=name,
        async_op=async_op,
    )


def all_gather(
    tensor: torch.Tensor,
    *,
    group: Group = None,
    name: str = "all_gather",
    async_op: bool = True,
) -> torch.futures.Future[torch.Tensor]:
    """Gather equal-shaped tensors; the future yields a stacked [world, *shape] tensor."""
    p = world_size(group)
    if p == 1:
        return _done_future(tensor.unsqueeze(0).clone())
    flat = torch.empty(p * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    src = tensor.reshape(-1).contiguous()
    return _issue(
        Collective.ALL_GATHER,
        tensor,
        flat.view(p, *tensor.shape),
        lambda: _all_gather_flat(flat, src, group=group, async_op=True),
        group=group,
        name=name,
        async_op=async_op,
    )


def broadcast(
    tensor: torch.Tensor,
    *,
    src: int,
    group: Group = None,
    name: str = "broadcast",
    async_op: bool = True,
) -> torch.futures.Future[torch.Tensor]:
    """In-place broadcast from global rank `src`; the future yields `tensor`."""
    if world_size(group) == 1:
        return _done_future(tensor)
    return _issue(
        Collective.BROADCAST,
        tensor,
        tensor,
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=True),
        group=group,
        name=name,
        async_op=async_op,
    )


def all_to_all(
    tensor: torch.Tensor,
    *,
    group: Group = None,
    name: str = "all_to_all",
    async_op: bool = True,
) -> torch.futures.Future[torch.Tensor]:
    """Exchange equal chunks: rank j receives chunk i of rank i's flat `tensor` as chunk i
    of its output (``[world, numel / world]``, yielded by the future).

    Raises:
        ValueError: the length does not divide by the world size.
    """
    p = world_size(group)
    if p == 1:
        return _done_future(tensor.reshape(1, -1).clone())
    if tensor.numel() % p:
        raise ValueError(f"all_to_all needs numel divisible by {p}, got {tensor.numel()}")
    src = tensor.reshape(-1).contiguous()
    out = torch.empty_like(src)
    return _issue(
        Collective.ALL_TO_ALL,
        src,
        out.view(p, -1),
        lambda: dist.all_to_all_single(out, src, group=group, async_op=True),
        group=group,
        name=name,
        async_op=async_op,
    )


def reduce_scatter(
    tensor: torch.Tensor,
    *,
    group: Group = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    name: str = "reduce_scatter",
    async_op: bool = True,
) -> torch.futures.Future[torch.Tensor]:
    """Reduce a flat tensor whose length divides by the world; yield this rank's shard."""
    p = world_size(group)
    if p == 1:
        return _done_future(tensor)
    if tensor.numel() % p:
        raise ValueError(f"reduce_scatter needs numel divisible by {p}, got {tensor.numel()}")
    out = torch.empty(tensor.numel() // p, dtype=tensor.dtype, device=tensor.device)
    return _issue(
        Collective.REDUCE_SCATTER,
        tensor,
        out,
        lambda: _reduce_scatter_flat(out, tensor.reshape(-1), op=op, group=group, async_op=True),
        group=group,
        name=name,
        async_op=async_op,
    )


# ------------------------------------------------------- control: barriers and objects
# Set-up and bookkeeping exchanges (a profile broadcast, checkpoint agreement, timings
# reduced over ranks) run synchronously and carry pickled objects whose size is unknown
# before they are sent: they are traced and fail as `CollectiveError`s like the rest, but
# are not counted in `plait.comm.stats` (whose windows hold a training step's traffic).


@contextlib.contextmanager
def _control(name: str, group: Group) -> Iterator[None]:
    """Trace the block as collective `name` and raise its failure as a `CollectiveError`."""
    start = tracer.now_us()
    with collective_errors(name, group), profiled(name):
        yield
    tracer.add(name, COMM, start, tracer.now_us(), thread="comm")


def barrier(*, group: Group = None, name: str = "barrier") -> None:
    """Wait until every rank of `group` reaches this point."""
    if world_size(group) == 1:
        return
    with _control(name, group):
        dist.barrier(group=group)


def all_gather_object(
    obj: Any, *, group: Group = None, name: str = "all_gather_object"
) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    p = world_size(group)
    if p == 1:
        return [obj]
    out: list[Any] = [None] * p
    with _control(name, group):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(
    obj: Any, *, src: int, group: Group = None, name: str = "broadcast_object"
) -> Any:
    """Global rank `src`'s `obj` (picklable) on every rank of `group`."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    with _control(name, group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def reduce_floats(
    values: list[float], *, op: str = "sum", group: Group = None, name: str = "reduce_floats"
) -> list[float]:
    """`values` reduced element-wise over the ranks of `group` (``sum``, ``mean``, ``max``
    or ``min``), in float64: timings, rates and counters every rank must agree on."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce_floats: op {op!r} is not one of {sorted(_REDUCE_OPS)}")
    p = world_size(group)
    if p == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    with _control(name, group):
        dist.all_reduce(t, op=_REDUCE_OPS[op], group=group)
    if op == "mean":
        t /= p
    return [float(v) for v in t.tolist()]
