"""Training strategies: how a model is distributed, and the registry that names them.

A strategy wraps the model (DDP with a comm hook, K-FAC hooks, ...), says how to run a
step without communication (for accumulation and for compute-only timing), may act
between backward and the optimizer step (K-FAC preconditions there), and checkpoints its
own state. The training loop and the benchmark harness only talk to this interface, so a
new strategy registers itself and needs no change to either.

Strategies that shard more than the data (n-D parallel plans) may also build the optimizer
(ZeRO), narrow the data axis to a subset of the ranks, drive forward and backward
themselves (pipeline schedules) and save sharded checkpoints; every such hook has a
default that keeps plain data parallelism as it was.

Strategies are selected by a spec string: a name, then options after a colon,
``"acpsgd:rank=4,warmup=10"``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from plait import distributed as pdist
from plait.comm import Collective
from plait.specs import parse_spec
from plait.workloads import Batch

#: Modules that register strategies when imported (looked up on first use).
_PLUGINS = (
    "plait.train.strategies.dp",
    "plait.train.strategies.local",
    "plait.train.strategies.torchft_diloco",
    "plait.train.strategies.kfac",
    "plait.train.strategies.parallel",
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Strategy(ABC):
    """Base class of training strategies. Subclasses set `name` and implement `wrap`."""

    name: str = ""
    #: Forward passes communicate (tensor/pipeline parallel, FSDP), so every rank must run
    #: the same number of them, evaluation included.
    collective_forward: bool = False

    def __init__(self, **options: Any) -> None:
        check_options(self.name, options, ())

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Return the model to train (e.g. wrapped in DDP). Called once, before the optimizer."""

    def check(self, model: nn.Module, *, world: int) -> None:  # noqa: B027
        """Raise ValueError if the strategy cannot run `model` on `world` ranks (called
        before launching, so a bad configuration fails at once instead of in the job)."""

    def collectives(self) -> frozenset[Collective]:
        """The collective kinds the strategy issues (checked against the backend before
        launch: ranks sharing a GPU talk through gloo, which runs some only on the CPU).
        By default DDP's: all-reduce, and broadcast and all-gather at wrap time."""
        return frozenset({Collective.ALL_REDUCE, Collective.BROADCAST, Collective.ALL_GATHER})

    def bind_data(self, sample: Batch, *, global_batch: int) -> None:  # noqa: B027
        """Called before `wrap` with one per-worker batch and the samples per step in all."""

    def bind_optimizer(self, factory: OptimizerFactory, *, name: str) -> None:  # noqa: B027
        """Called before `wrap` with the factory `build_optimizer` will get and the
        optimizer's name (a planner that trains trial steps meters its states)."""

    def build_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer over the wrapped model (ZeRO strategies shard it here)."""
        return factory(model.parameters())

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027
        """Called once the optimizer over the wrapped model's parameters exists."""

    def data_parallel_rank(self) -> int:
        """Which shard of the data this rank reads."""
        return pdist.rank()

    def data_parallel_size(self) -> int:
        """Shards the data is split into (ranks that share a shard get the same batches)."""
        return pdist.world_size()

    def forward_backward(
        self, model: nn.Module, micro: list[Batch], loss_fn: LossFn
    ) -> float | None:
        """Forward and backward over the micro-batches, returning the step's loss; or None
        to let the caller run its own loop (the default). Pipelines schedule them here."""
        return None

    def eval_forward(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor | None:
        """The model's output for evaluation; None where this rank has none (a pipeline's
        first stages)."""
        return self.unwrap(model)(x)  # type: ignore[no-any-return]

    def eval_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context around a whole evaluation: the parameters evaluation should see (a
        local-update strategy swaps in the shared copy the workers agree on)."""
        return contextlib.nullcontext()

    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """Model and optimizer state that every rank saves its shard of (through
        torch.distributed.checkpoint), or None: rank 0 saves full state dicts (default)."""
        return None

    def load_checkpoint_state(  # noqa: B027
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Restore `checkpoint_state` output, loaded in place."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context for a forward/backward that must not communicate (accumulation steps)."""
        no_sync = getattr(model, "no_sync", None)
        if callable(no_sync):
            return no_sync()  # type: ignore[no-any-return]
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def compute_only(self, model: nn.Module) -> Iterator[None]:
        """A whole step with no communication: the compute-only reference of benchmarks."""
        with self.no_sync(model):
            yield

    def observe_loss(self, loss: float) -> None:  # noqa: B027
        """This rank's training loss of the step, given before `before_optimizer_step`
        (K-FAC's ``"auto"`` intervals weigh the progress it shows)."""

    def before_optimizer_step(self, model: nn.Module) -> None:  # noqa: B027
        """Called after backward (communication finished), before `optimizer.step()`."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever `wrap` returned."""
        return model.module if hasattr(model, "module") else model  # type: ignore[return-value]

    def state_dict(self) -> dict[str, Any]:
        """Rank-local state to checkpoint (error buffers, factors, counters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore `state_dict()` output."""

    def close(self) -> None:  # noqa: B027
        """Release threads and buffers."""

    def describe(self) -> str:
        return self.name


StrategyFactory = Callable[..., Strategy]
_REGISTRY: dict[str, StrategyFactory] = {}
_PLUGINS_LOADED: list[bool] = []
_PLUGINS_LOCK = threading.RLock()  # others wait for the first import; the importer may re-enter


def register_strategy(name: str) -> Callable[[StrategyFactory], StrategyFactory]:
    """Class decorator: make a strategy selectable as `name` (``--strategy name:opts``)."""

    def deco(factory: StrategyFactory) -> StrategyFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"strategy {name!r} is registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def _load_plugins() -> None:
    with _PLUGINS_LOCK:
        if _PLUGINS_LOADED:
            return
        _PLUGINS_LOADED.append(True)
        for mod in _PLUGINS:
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as exc:
                # the plugin (or its package) is not installed; a missing dependency is an error
                if exc.name is None or not (mod == exc.name or mod.startswith(exc.name + ".")):
                    raise


def available_strategies() -> list[str]:
    _load_plugins()
    return sorted(_REGISTRY)


def keyword_options(cls: type, *, exclude: Iterable[str] = ("self", "group")) -> list[str]:
    """The keyword arguments `cls(...)` accepts, following ``**kwargs`` up the MRO.

    Strategies use it to list the options a component (a compressor, a config) takes, so
    an unknown option is refused with the accepted names instead of a TypeError at launch.
    """
    names: list[str] = []
    skip = set(exclude)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        more = False
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                more = True
            elif (
                p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.name not in skip
                and p.name not in names
            ):
                names.append(p.name)
        if not more:
            break
    return names


def check_options(strategy: str, options: Mapping[str, Any], accepted: Iterable[str]) -> None:
    """Refuse options `strategy` does not take, naming the first and listing the accepted.

    Raises:
        ValueError: ``unknown option 'rnak' for strategy 'acpsgd' (accepted: rank, ...)``.
    """
    known = sorted(set(accepted))
    for key in options:
        if key not in known:
            raise ValueError(
                f"unknown option {key!r} for strategy {strategy!r} "
                f"(accepted: {', '.join(known) if known else 'none'})"
            )


def make_strategy(spec: str, **overrides: Any) -> Strategy:
    """The strategy a spec names, with its options (plus `overrides`) applied.

    Constructing a strategy builds nothing (no model, no process group, no thread): it
    only checks the options, so a bad spec fails before anything is launched.

    Raises:
        ValueError: unknown name, unknown option or a bad option value; the message names
            the strategy and what it accepts.
    """
    _load_plugins()
    name, options = parse_spec(spec)
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(sorted(_REGISTRY))}")
    options.update(overrides)
    try:
        return _REGISTRY[name](**options)
    except TypeError as exc:
        raise ValueError(f"invalid options for strategy {name!r}: {exc}") from exc
    except ValueError as exc:
        if f"{name!r}" in str(exc) or str(exc).startswith(f"{name}:"):
            raise
        raise ValueError(f"strategy {name!r}: {exc}") from exc


def validate_spec(spec: str) -> None:
    """Check a strategy spec completely (name, option names and values) and build nothing.

    The command line calls this in the parent process, before any cluster or worker
    exists, so a typo fails with one line instead of a traceback per rank.

    Raises:
        ValueError: as `make_strategy`.
    """
    make_strategy(spec).close()
