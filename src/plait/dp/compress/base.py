"""The compressor interface: a stateful DDP communication hook.

A compressor is passed to ``DistributedDataParallel.register_comm_hook(state, hook)`` as
both halves: ``model.register_comm_hook(comp, type(comp).hook)`` or simply
``comp.register(model)``. DDP calls the hook once per gradient bucket, in bucket order,
on the autograd thread, while backward continues; the hook returns a future of the
averaged bucket. Compressors count bytes and trace spans through `plait.comm`.

Stateful compressors keep their state per *parameter*, not per bucket: DDP builds its
buckets once in registration order, rebuilds them in gradient-ready order after the first
step, and a resumed run starts from the first layout again, so only per-parameter state
(keyed by parameter name) survives all of that and checkpoints independently of buckets.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch._C._distributed_c10d import GradBucket

from plait.comm.ops import wait
from plait.comm.stats import Collective
from plait.distributed import retain_group

_REGISTRY: dict[str, type[Compressor]] = {}


class Compressor(ABC):
    """Base class. Subclasses set `name` and implement `hook`.

    Args:
        group: process group to communicate in (None: the default group).
    """

    name: ClassVar[str] = ""
    #: Whether the compressor needs all gradients in one DDP bucket (see torch-powersgd).
    single_bucket: ClassVar[bool] = False
    #: The collective kinds its hook issues.
    collectives: ClassVar[frozenset[Collective]] = frozenset({Collective.ALL_REDUCE})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _REGISTRY[cls.name] = cls
        hook = cls.__dict__.get("hook")
        if hook is not None and not getattr(hook, "__isabstractmethod__", False):
            # DDP compares annotations with the real types (of the signature, which
            # follows the wrapper to `hook`); postponed (string) annotations would fail
            # its check, so store the objects.
            hook.__annotations__ = {
                "bucket": GradBucket,
                "return": torch.futures.Future[torch.Tensor],
            }
            guarded = _guarded(hook)
            guarded.__annotations__ = dict(hook.__annotations__)
            cls.hook = guarded  # type: ignore[method-assign]

    def __init__(self, *, group: Any = None) -> None:
        self.group = group
        self._names: dict[int, str] = {}
        #: this backward pass's bucket futures, checked when backward ends (`_watch`)
        self._bucket_futures: list[torch.futures.Future[torch.Tensor]] = []
        self._group_retained = False

    def _watch(self, fut: torch.futures.Future[torch.Tensor]) -> None:
        """Check `fut` when the backward pass that issued it ends.

        DDP re-raises a failed hook future as a RuntimeError whose text holds the
        `CollectiveError`, so ``except CollectiveError`` would catch nothing. A callback
        queued on the autograd engine runs before DDP's own end-of-backward callback, and
        an exception it raises reaches ``loss.backward()`` with its Python class; it waits
        on every bucket of the pass and raises the first failure as a `CollectiveError`.
        """
        if not self._group_retained:
            retain_group(self.group)  # see `retain_group`: no hang at interpreter exit
            self._group_retained = True
        if not self._bucket_futures:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._check_pending)
            except RuntimeError:  # called outside a backward pass (a direct call, a test)
                return
        self._bucket_futures.append(fut)

    def _check_pending(self) -> None:
        pending, self._bucket_futures = self._bucket_futures, []
        for fut in pending:
            wait(fut)  # a failed bucket raises its CollectiveError here

    @abstractmethod
    def hook(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Average `bucket.buffer()` across workers (possibly approximately)."""

    def payload_nbytes(self, name: str, param: torch.Tensor) -> float:
        """Bytes this compressor sends per step for `param`'s gradient (on average)."""
        return float(param.numel() * param.element_size())

    def compression_ratio(self, model: nn.Module) -> float:
        """Bytes sent over bytes of the dense gradient (1.0 for uncompressed)."""
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dense = sum(p.numel() * p.element_size() for _, p in params)
        if dense == 0:
            return 1.0
        return sum(self.payload_nbytes(n, p) for n, p in params) / dense

    def bind(self, model: nn.Module) -> None:
        """Learn the parameter names of `model`, to key per-parameter state by name.

        `register` calls it. A compressor registered with a bare `register_comm_hook` names
        parameters ``param{i}`` in the order DDP first hands them over, which is the same in
        every run of the same model, so its checkpoints still resume.
        """
        self._names = {id(p): n for n, p in model.named_parameters()}

    def param_name(self, param: torch.Tensor) -> str:
        """The name `param` is known by (see `bind`)."""
        key = id(param)
        name = self._names.get(key)
        if name is None:
            name = f"param{len(self._names)}"
            self._names[key] = name
        return name

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self.bind(ddp.module)
        ddp.register_comm_hook(self, type(self).hook)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"compressor {self.name!r} has no state, got keys {sorted(state)}")

    def close(self) -> None:  # noqa: B027 - optional for stateless compressors
        """Stop threads; called when training ends."""


def _guarded(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` whose futures are checked at the end of backward (`Compressor._watch`)."""

    @functools.wraps(hook)
    def guarded(self: Compressor, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = hook(self, bucket)
        self._watch(fut)
        return fut

    return guarded


def compressor_class(name: str) -> type[Compressor]:
    """The compressor registered as `name`."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; choose from {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def compressor_names() -> list[str]:
    return sorted(_REGISTRY)


def check_positive(name: str, value: float, *, integer: bool = False) -> None:
    """ValueError unless `value` is a positive number (an int if `integer`)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
