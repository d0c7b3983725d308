"""torchft's DiLoCo as a strategy: ``torchft-diloco`` (the ``bench`` extra).

``--strategy torchft-diloco:sync_every=20`` trains with `torchft.local_sgd.DiLoCo` as
torchft 0.2.0 ships it: its own `Manager`, its own process groups, its own outer step and
fragment schedule. plait only builds and drives it, so a race can put torchft's
implementation beside plait's own ``diloco`` (`plait.dp.local`).

How it is set up on a plait job of W ranks:
- every rank is a torchft replica group of one (torchft's world size 1 inside it), with
  a TCPStore of its own and a replica id that ends in its rank;
- rank 0 starts a lighthouse (torchft's quorum server, ``min_replicas=W``) for this
  strategy alone (two entries of a race never share a quorum) and hands its address to
  the others through plait's own process group (`plait.comm.broadcast`);
- every server advertises the node's own address (`plait.cluster.node_address`), not the
  host name the emulated nodes share;
- the managers run with ``use_async_quorum=False`` (DiLoCo requires it) and
  ``init_sync=False``: the ranks start from rank 0's weights, broadcast by plait as
  plait's ``diloco`` does, so torchft has nothing to heal at its first quorum;
- every wait is finite (`timeout_s`: connection, quorum, collectives) and the first failed
  commit raises (``max_retries=0``): a lost peer ends the job with a `CollectiveError`
  instead of being retried against a quorum that can never form again.

Evaluation sees the parameters the replicas agree on: the copy of each fragment that
torchft keeps as the start of the next round (its ``original_parameters``), identical on
every rank. Checkpoints hold what torchft transfers to a recovering replica (the state
dict functions registered with the manager: each fragment's global copy and outer
optimizer, this rank's model and inner optimizer, the manager's step) plus the position
in the round and any fragment exchange in flight, so a resumed run continues exactly.

torchft's traffic bypasses `plait.comm` (its process groups are its own); the bytes it
hands to its all-reduce are recorded in `plait.comm.stats` so that races count them like
any other entry's. Buffers (batch-norm statistics) are not synchronised: torchft's DiLoCo
averages parameters only.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib.metadata
import importlib.util
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch import nn

from plait import distributed as pdist
from plait.cluster import node_address
from plait.comm import Collective, CollectiveError, broadcast, stats
from plait.dp.local import fragments as frag
from plait.dp.local.codecs import flatten, unflatten
from plait.train.strategy import Strategy, check_options, register_strategy

logger = logging.getLogger(__name__)

#: The torchft release this strategy drives (the ``bench`` extra pins it): it reads the
#: global copy and the round's position from DiLoCo's attributes, which are not public.
TORCHFT_VERSION = "0.2.0"
_STATE_FORMAT = 1
#: Longest address the lighthouse's host hands to the other ranks (bytes, with status).
_ADDRESS_BYTES = 512


class _NoFlightRecorderNote(logging.Filter):
    """Drops torchft's note, at every quorum change, that NCCL's flight recorder cannot be
    reset: this strategy runs torchft on gloo, where there is no such recorder."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


def torchft_missing() -> str | None:
    """Why torchft cannot be used here, or None when it can."""
    if importlib.util.find_spec("torchft") is None:
        return (
            "strategy 'torchft-diloco' needs torchft, which is not installed: "
            f"pip install 'plait[bench]' (torchft=={TORCHFT_VERSION})"
        )
    return None


@dataclass(frozen=True, kw_only=True)
class TorchftConfig:
    """The options of ``torchft-diloco``, checked where they are written.

    Attributes:
        sync_every: H, inner steps per round (torchft's ``sync_every``); one fragment
            synchronises every ``sync_every / fragments`` steps.
        outer_lr: the outer SGD's learning rate (0.7: DiLoCo's paper).
        outer_momentum: its Nesterov momentum (0.9: the paper); 0 is plain outer SGD.
        fragments: the model split into this many fragments (Streaming DiLoCo), units
            dealt out strided as plait's ``diloco`` does (`plait.dp.local.fragments`).
        fragment_sync_delay: tau, inner steps a fragment's all-reduce overlaps with.
        fragment_update_alpha: the share of the local parameters kept when the global
            ones arrive (torchft's ``lerp``; 0 adopts the global copy).
        should_quantize: torchft's quantised all-reduce (Triton kernels on a GPU).
        use_bucketization: one all-reduce per bucket instead of one per parameter.
        bucket_cap_mb: the bucket size (0: torchft's default, 1 GiB).
        timeout_s: how long a connection, a quorum or an all-reduce may wait (None: the
            job's collective timeout, PLAIT_TIMEOUT).
    """

    sync_every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    should_quantize: bool = False
    use_bucketization: bool = False
    bucket_cap_mb: int = 0
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        for key, low in (
            ("sync_every", 1),
            ("fragments", 1),
            ("fragment_sync_delay", 0),
            ("bucket_cap_mb", 0),
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        for key in ("should_quantize", "use_bucketization"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false, got {getattr(self, key)!r}")
        _number("outer_lr", self.outer_lr, ok=lambda v: v > 0, bound="> 0")
        _number("outer_momentum", self.outer_momentum, ok=lambda v: 0 <= v < 1, bound="in [0, 1)")
        _number(
            "fragment_update_alpha",
            self.fragment_update_alpha,
            ok=lambda v: 0 <= v <= 1,
            bound="in [0, 1]",
        )
        if self.timeout_s is not None:
            _number("timeout_s", self.timeout_s, ok=lambda v: v > 0, bound="> 0")
        if self.sync_every % self.fragments:
            raise ValueError(
                f"sync_every ({self.sync_every}) must be a multiple of fragments "
                f"({self.fragments}): torchft synchronises one fragment every "
                "sync_every / fragments steps"
            )
        if self.fragment_sync_delay >= self.sync_every // self.fragments:
            raise ValueError(
                f"fragment_sync_delay ({self.fragment_sync_delay}) must be below sync_every / "
                f"fragments ({self.sync_every // self.fragments}): a fragment's all-reduce "
                "must land before the next fragment's starts"
            )
        if self.should_quantize and not (
            torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
        ):
            raise ValueError(
                "should_quantize needs Triton and a CUDA device: torchft quantises with "
                "Triton kernels and otherwise sends fp32 without saying so"
            )

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _number(name: str, value: Any, *, ok: Any, bound: str) -> None:
    good = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not (good and ok(value)):
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")


def _share_text(text: str | None, device: torch.device) -> str:
    """Rank 0's `text` on every rank, through plait's process group."""
    buf = torch.zeros(_ADDRESS_BYTES, dtype=torch.uint8)
    if text is not None:
        raw = text.encode()[:_ADDRESS_BYTES]
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    buf = buf.to(device)
    broadcast(buf, src=0, name="torchft lighthouse address", async_op=False)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace")


def _instrument(manager: Any, *, rank: int, world: int, timeout_s: float) -> None:
    """Count and explain what `manager` does, without changing it.

    torchft's all-reduces bypass `plait.comm`: the bytes handed to them are recorded in
    `plait.comm.stats`, so a race counts them like any other entry's. A quorum that does
    not form, and a commit refused after a failed all-reduce (the first one raises:
    ``max_retries=0``), become a `CollectiveError` that says what happened in plait's
    terms; torchft's own error (``TimeoutError: status: Cancelled``) is its cause.
    """
    reduce, quorum, commit = manager.allreduce, manager.start_quorum, manager.should_commit
    ranks = tuple(range(world))

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        stats.add(Collective.ALL_REDUCE, tensor.numel() * tensor.element_size(), world)
        return reduce(tensor, *args, **kwargs)

    def start_quorum(*args: Any, **kwargs: Any) -> Any:
        try:
            return quorum(*args, **kwargs)
        except Exception as exc:
            raise CollectiveError(
                f"torchft's quorum did not form on rank {rank} within {timeout_s:g}s: a peer "
                f"of ranks {list(ranks)} is lost, stopped or too slow; cause: "
                f"{type(exc).__name__}: {exc}",
                collective="torchft quorum",
                ranks=ranks,
            ) from exc

    def should_commit(*args: Any, **kwargs: Any) -> Any:
        try:
            return commit(*args, **kwargs)
        except RuntimeError as exc:
            cause = manager.errored()
            raise CollectiveError(
                f"torchft's all-reduce of pseudo-gradients failed on rank {rank} (ranks "
                f"{list(ranks)}): a peer is lost or stopped; cause: "
                f"{cause.original_exception if cause is not None else exc}",
                collective="torchft allreduce",
                ranks=ranks,
            ) from exc

    manager.allreduce = counted
    manager.start_quorum = start_quorum
    manager.should_commit = should_commit


@register_strategy("torchft-diloco")
class TorchftDiLoCoStrategy(Strategy):
    """torchft's DiLoCo driven by plait (`TorchftConfig`'s fields are its options)."""

    name = "torchft-diloco"

    def __init__(self, **options: Any) -> None:
        check_options(self.name, options, TorchftConfig.option_names())
        self.config = TorchftConfig(**options)
        missing = torchft_missing()
        if missing is not None:
            raise ValueError(missing)
        self.options = options
        self._model: nn.Module | None = None
        self._params: list[nn.Parameter] = []
        self._fragments: list[nn.ParameterList] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._lighthouse: Any = None
        self._store: Any = None
        self._pg: Any = None
        self._manager: Any = None
        self._diloco: Any = None
        self._entered = False
        self._pending_state: dict[str, Any] | None = None

    # ---------------------------------------------------------------- set-up
    def check(self, model: nn.Module, *, world: int) -> None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError(f"{type(model).__name__} has no trainable parameters")
        frag.split(names, self.config.fragments)

    def wrap(self, model: nn.Module) -> nn.Module:
        """Start from rank 0's weights and split the model into fragments; the managers
        start with the optimizer (`attach_optimizer`), which they checkpoint."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.check(model, world=pdist.world_size())
        parts = frag.split([n for n, _ in named], self.config.fragments)
        self._model = model
        self._params = [p for _, p in named]
        self._fragments = [nn.ParameterList([named[i][1] for i in idx]) for idx in parts]
        if dist.is_initialized() and dist.get_world_size() > 1:
            tensors = [*self._params, *(b for b in model.buffers() if b.is_floating_point())]
            flat = flatten([t.detach() for t in tensors])
            broadcast(flat, src=0, name="torchft initial weights", async_op=False)
            with torch.no_grad():
                for t, v in zip(tensors, unflatten(flat, tensors), strict=True):
                    t.copy_(v)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        assert self._model is not None, "wrap() before attach_optimizer()"
        self._optimizer = optimizer
        try:
            self._start(optimizer)
        except BaseException:
            self.close()
            raise
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    def _start(self, optimizer: torch.optim.Optimizer) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        manager_log = logging.getLogger("torchft.manager")
        if not any(isinstance(f, _NoFlightRecorderNote) for f in manager_log.filters):
            manager_log.addFilter(_NoFlightRecorderNote())
        version = importlib.metadata.version("torchft")
        if version != TORCHFT_VERSION:
            logger.warning("torchft %s installed; plait drives %s", version, TORCHFT_VERSION)
        cfg = self.config
        rank, world = pdist.rank(), pdist.world_size()
        host = node_address()
        seconds = cfg.timeout_s or pdist.collective_timeout().total_seconds()
        timeout = datetime.timedelta(seconds=seconds)
        lighthouse = self._lighthouse_address(LighthouseServer, host, rank, world)
        store: Any = getattr(dist, "TCPStore")  # noqa: B009  # not re-exported in torch's stubs
        self._store = store(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self._pg = ProcessGroupGloo(timeout=timeout)
        self._manager = Manager(
            pg=self._pg,
            load_state_dict=self._load_own_state,
            state_dict=self._own_state,
            min_replica_size=world,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=self._store.port,
            lighthouse_addr=lighthouse,
            replica_id=f"plait_rank{rank}",
            hostname=host,
            init_sync=False,
            max_retries=0,
        )
        _instrument(self._manager, rank=rank, world=world, timeout_s=seconds)
        outer = [
            torch.optim.SGD(
                f.parameters(),
                lr=cfg.outer_lr,
                momentum=cfg.outer_momentum,
                nesterov=cfg.outer_momentum > 0,
            )
            for f in self._fragments
        ]
        self._diloco = DiLoCo(
            self._manager,
            list(self._fragments),
            optimizer,
            outer,
            sync_every=cfg.sync_every,
            should_quantize=cfg.should_quantize,
            fragment_sync_delay=cfg.fragment_sync_delay,
            fragment_update_alpha=cfg.fragment_update_alpha,
            use_bucketization=cfg.use_bucketization,
            bucket_cap_mb=cfg.bucket_cap_mb or None,
        )
        for name in ("_fragments", "_local_step"):
            if not hasattr(self._diloco, name):
                raise RuntimeError(
                    f"torchft {version}'s DiLoCo lacks {name}: use {TORCHFT_VERSION}"
                )
        self._diloco.__enter__()
        self._entered = True

    def _lighthouse_address(self, server: Any, host: str, rank: int, world: int) -> str:
        """Start this strategy's lighthouse on rank 0; its address, on every rank.

        Rank 0 sends an error instead of an address when the lighthouse fails to start,
        so that the other ranks raise at once instead of waiting for a quorum.
        """
        text: str | None = None
        if rank == 0:
            try:
                self._lighthouse = server(bind=f"{host}:0", min_replicas=world)
                text = f"ok http://{host}:{urlsplit(self._lighthouse.address()).port}"
            except Exception as exc:
                text = f"error {type(exc).__name__}: {exc}"
                raise
            finally:
                if world > 1:
                    _share_text(text, pdist.device())
        else:
            text = _share_text(None, pdist.device())
        status, _, address = text.partition(" ")
        if status != "ok":
            raise RuntimeError(f"rank 0 could not start torchft's lighthouse: {address}")
        return address

    def _own_state(self) -> dict[str, Any]:
        """This replica's model and inner optimizer (torchft's user state dict)."""
        assert self._optimizer is not None
        return {
            "params": [p.detach().clone() for p in self._params],
            "inner": copy.deepcopy(self._optimizer.state_dict()),
        }

    def _load_own_state(self, state: dict[str, Any]) -> None:
        assert self._optimizer is not None
        saved = state["params"]
        if len(saved) != len(self._params) or any(
            s.shape != p.shape for s, p in zip(saved, self._params, strict=True)
        ):
            raise ValueError("torchft-diloco state does not match the model's parameters")
        with torch.no_grad():
            for p, s in zip(self._params, saved, strict=True):
                p.copy_(s)
        self._optimizer.load_state_dict(state["inner"])

    # ------------------------------------------------------------ the steps
    @contextlib.contextmanager
    def compute_only(self, model: nn.Module) -> Iterator[None]:
        """Steps inside do not count towards a round (torchft's hooks are off)."""
        if not self._entered:
            yield
            return
        self._diloco.__exit__(None, None, None)
        try:
            yield
        finally:
            self._diloco.__enter__()

    def eval_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return self._consensus()

    @contextlib.contextmanager
    def _consensus(self) -> Iterator[None]:
        """torchft's global copy of every fragment in the model for the block."""
        if self._diloco is None:
            yield
            return
        with torch.no_grad():
            saved = [p.detach().clone() for p in self._params]
            for module, fragment in zip(self._fragments, self._diloco._fragments, strict=True):
                for name, p in module.named_parameters():
                    p.copy_(fragment.original_parameters[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self._params, saved, strict=True):
                    p.copy_(s)

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torchft's recovery state (every registered state dict function and the
        manager's step), the position in the round, and the exchanges in flight (waited
        for and averaged, not applied: they land on their own step)."""
        if self._manager is None:
            return {}
        d = self._diloco
        in_flight = {}
        for i, fragment in enumerate(d._fragments):
            if fragment._allreduce_work:
                for work in fragment._allreduce_work:
                    work.wait()
                in_flight[str(i)] = {n: g.clone() for n, g in fragment._grads.items()}
        return {
            "format": _STATE_FORMAT,
            "sync_every": self.config.sync_every,
            "fragments": self.config.fragments,
            "fragment_sync_delay": self.config.fragment_sync_delay,
            "torchft": copy.deepcopy(self._manager._manager_state_dict()),
            "round_step": int(d._local_step),
            "in_flight": in_flight,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self._manager is None:
            self._pending_state = state
            return
        if state.get("format") != _STATE_FORMAT:
            raise ValueError("not a torchft-diloco state")
        for key in ("sync_every", "fragments", "fragment_sync_delay"):
            if state.get(key) != getattr(self.config, key):
                raise ValueError(
                    f"torchft-diloco state saved with {key}={state.get(key)!r}, this run uses "
                    f"{getattr(self.config, key)!r}"
                )
        from torchft.work import _DummyWork

        saved = state["torchft"]
        for key, load in self._manager._load_state_dict_fns.items():
            load(saved["user"][key])
        self._manager.load_state_dict(saved["torchft"])
        d = self._diloco
        d._local_step = int(state["round_step"])
        if state["in_flight"]:
            # the exchange's quorum is gone with the old managers: form the round's again
            self._manager.start_quorum()
        for i, grads in state["in_flight"].items():
            fragment = d._fragments[int(i)]
            fragment._grads = {n: torch.as_tensor(g) for n, g in grads.items()}
            fragment._allreduce_work = [_DummyWork(None)]

    # -------------------------------------------------------------- the end
    def close(self) -> None:
        """Unhook DiLoCo, then stop the manager (its server and threads), the process
        group and, on rank 0, the lighthouse."""
        if self._entered:
            self._diloco.__exit__(None, None, None)
            self._entered = False
        if self._manager is not None:
            with contextlib.suppress(Exception):
                self._manager.shutdown(wait=False)
            self._manager = None
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg.shutdown()
            self._pg = None
        self._store = None
        if self._lighthouse is not None:
            with contextlib.suppress(Exception):
                self._lighthouse.shutdown()
            self._lighthouse = None
        self._diloco = None

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.name}:{opts}" if opts else self.name
