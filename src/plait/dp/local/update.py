"""`LocalUpdate`: DiLoCo-style local-update training around the user's own model.

Each worker trains its own copy of the model with its own (inner) optimizer on its own
data for H steps, without communicating. Then the workers average their *pseudo-
gradients*, the parameters at the start of the round minus the parameters now, and an
outer optimizer (Nesterov SGD in DiLoCo) applies that average to a shared copy of the
parameters, which every worker adopts as the start of the next round (Douillard et al.,
2023). With H = 1, outer SGD at lr 1 without momentum and inner SGD, this is exactly
synchronous data parallelism; with H = 50 a worker sends 50x less.

Streaming DiLoCo (Douillard et al., 2025) adds two things this wrapper has too:
- fragments: the model is split into F fragments synchronised on a stagger, one every
  H / F steps, so the link carries 1/F of the model at a time instead of all of it at
  once (`plait.dp.local.fragments`);
- overlap: a fragment's exchange runs on a communication thread while the next `delay`
  (tau) inner steps compute; its result then lands and is mixed into the local copy,
  local := alpha * local + (1 - alpha) * global, so the steps taken meanwhile are not
  thrown away.
The pseudo-gradient may travel compressed, with error feedback (`plait.dp.local.codecs`).

The wrapper is a drop-in for `DistributedDataParallel` in a training loop: the outer step
runs inside the optimizer's ``step()`` (a post-step hook), so the loop does not change.
It finds the optimizer by itself (the one stepping the largest share of the model's
parameters; call `attach` to name it, which you should when several optimizers share the
model and H is 1). Every collective goes through `plait.comm` on a process group of its
own, with the group's timeout, so a lost peer raises `CollectiveError` on the survivors.

Memory: one more copy of the parameters (the shared copy) and the outer optimizer's
state (one more for momentum), as in the paper.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from plait.comm import CollectiveQueue, all_reduce, broadcast, wait, world_size
from plait.dp.compress.powersgd import duplicate_group
from plait.dp.local import fragments as frag
from plait.dp.local.codecs import flatten, make_codec, unflatten
from plait.dp.local.config import LocalConfig, OuterOptimizer
from plait.persist import from_plain, to_plain
from plait.trace import COMM, span

logger = logging.getLogger(__name__)

#: Key of the outer state in a `LocalUpdate` model's ``state_dict()``.
STATE_KEY = "plait_local"
_STATE_FORMAT = 1

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def default_outer_factory(config: LocalConfig) -> OuterFactory:
    """The outer optimizer `config` names, as a factory over a fragment's tensors."""
    lr, mom = config.outer_lr, config.outer_momentum
    if config.outer_optimizer is OuterOptimizer.NESTEROV:
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=mom, nesterov=mom > 0)
    if config.outer_optimizer is OuterOptimizer.SGD:
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=mom)
    assert config.outer_optimizer is OuterOptimizer.ADAM, config.outer_optimizer
    return lambda ps: torch.optim.Adam(ps, lr=lr, betas=(mom, 0.999))


@dataclass
class _Exchange:
    """A fragment's exchange in flight: it lands after inner step `due`."""

    due: int
    future: torch.futures.Future[tuple[list[torch.Tensor], torch.Tensor | None]]


class LocalUpdate(nn.Module):
    """Local-update data parallelism (DiLoCo, Streaming DiLoCo); see the module docstring.

    Args:
        module: the model to train; its parameters must live on one device.
        config: the method's settings (`LocalConfig`); default: DiLoCo with H = 50.
        group: process group (None: the default group).
        outer_factory: builds the outer optimizer over a list of tensors (one per
            fragment), for an optimizer `OuterOptimizer` does not name; default: the
            one `config` names.

    Raises:
        ValueError: no process group, no trainable parameters, parameters on several
            devices, a model already wrapped, or more fragments than the model has units.
    """

    def __init__(
        self,
        module: nn.Module,
        config: LocalConfig | None = None,
        *,
        group: Any = None,
        outer_factory: OuterFactory | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise ValueError("local-update training needs an initialised process group")
        if not isinstance(module, nn.Module):
            raise ValueError(f"expected an nn.Module, got {type(module).__name__}")
        if isinstance(module, nn.parallel.DistributedDataParallel | LocalUpdate):
            raise ValueError(f"the model is already wrapped ({type(module).__name__})")
        cfg = config or LocalConfig()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{type(module).__name__} has no trainable parameters")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"parameters on several devices: {sorted(map(str, devices))}")
        names = [n for n, _ in named]
        parts = frag.split(names, cfg.fragments)
        self.module = module
        self.config = cfg
        self.group = group
        self.names = names
        self.params = [p for _, p in named]
        self.parts = parts
        self.buffers_of = self._buffers_by_fragment(module, names, parts)
        self._group = duplicate_group(group)
        self._broadcast_from_rank0()
        #: the shared copy the outer optimizer steps (one tensor per parameter)
        self.shared = [p.detach().clone() for p in self.params]
        make = outer_factory or default_outer_factory(cfg)
        self.outer = [make([self.shared[i] for i in idx]) for idx in parts]
        self.codec = make_codec(cfg)
        self.queue = CollectiveQueue(name="outer", timeout_s=cfg.timeout_s) if cfg.delay else None
        #: inner optimizer steps taken so far (the schedule's clock)
        self.steps = 0
        self._pending: dict[int, _Exchange] = {}
        self._paused = 0
        self._closed = False
        self._param_ids = {id(p) for p in self.params}
        self._covers: dict[int, int] = {}
        self._clock: int | None = None
        self._clock_cover = 0
        self._handles: list[Any] = []
        me = weakref.ref(self)

        def on_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            wrapper = me()
            if wrapper is not None:
                wrapper._on_optimizer_step(opt)

        handle = register_optimizer_step_post_hook(on_step)
        self._handles.append(handle)
        weakref.finalize(self, handle.remove)
        self.register_state_dict_post_hook(_save_state)
        self.register_load_state_dict_pre_hook(_load_state)

    # ---------------------------------------------------------------- set-up
    @staticmethod
    def _buffers_by_fragment(
        module: nn.Module, names: Sequence[str], parts: Sequence[Sequence[int]]
    ) -> list[list[torch.Tensor]]:
        """Floating-point buffers (running statistics) per fragment, by unit; a buffer
        whose unit holds no trainable parameter goes with fragment 0."""
        where = {frag.unit_of(names[i]): f for f, idx in enumerate(parts) for i in idx}
        out: list[list[torch.Tensor]] = [[] for _ in parts]
        for name, buf in module.named_buffers():
            if buf.is_floating_point():
                out[where.get(frag.unit_of(name), 0)].append(buf)
        return out

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Every worker starts from rank 0's parameters and buffers, as DDP does."""
        tensors = [*self.params, *(b for bs in self.buffers_of for b in bs)]
        flat = flatten(tensors)
        src = dist.get_global_rank(self._group, 0) if self._group is not None else 0
        broadcast(flat, src=src, group=self._group, name="outer initial", async_op=False)
        for t, v in zip(tensors, unflatten(flat, tensors), strict=True):
            t.copy_(v)

    # ------------------------------------------------------------ the clock
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Count inner steps on `optimizer`'s steps only (instead of finding it)."""
        for h in self._handles:
            h.remove()
        me = weakref.ref(self)

        def on_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            wrapper = me()
            if wrapper is not None:
                wrapper.after_inner_step()

        self._handles = [optimizer.register_step_post_hook(on_step)]
        self._clock = id(optimizer)

    def _on_optimizer_step(self, opt: torch.optim.Optimizer) -> None:
        """Any optimizer's step: count it if `opt` is the clock (see the module docstring)."""
        key = id(opt)
        cover = self._covers.get(key)
        if cover is None:
            ids = {id(p) for g in opt.param_groups for p in g["params"]}
            cover = self._covers[key] = len(ids & self._param_ids)
        if cover == 0:
            return
        if self._clock is None or cover > self._clock_cover:
            # a wider optimizer (say, one holding two inner ones) takes over; the steps
            # counted so far stand, this one's step is the one already counted
            first = self._clock is None
            self._clock, self._clock_cover = key, cover
            if not first:
                return
        if key == self._clock:
            self.after_inner_step()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Steps inside do not count (compute-only timing, probes)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # --------------------------------------------------------------- rounds
    def after_inner_step(self) -> None:
        """One inner step was taken: land the exchanges due now, start those due next."""
        if self._paused or self._closed:
            return
        self.steps += 1
        t = self.steps
        for f in sorted(f for f, x in self._pending.items() if x.due <= t):
            self._land(f)
        for f in frag.starts(t, self.config.fragments, self.config.inner_steps):
            self._launch(f, t)

    @torch.no_grad()
    def _launch(self, f: int, step: int) -> None:
        idx = self.parts[f]
        deltas = [(self.shared[i] - self.params[i].detach()).float() for i in idx]
        bufs = flatten(self.buffers_of[f]) if self.buffers_of[f] else None
        job = functools.partial(self._exchange, f, [self.names[i] for i in idx], deltas, bufs)
        if self.queue is None:
            self._outer_step(f, *job())
        else:
            fut = self.queue.submit(job, name=f"outer fragment {f}")
            self._pending[f] = _Exchange(due=step + self.config.delay, future=fut)

    def _exchange(
        self, f: int, names: list[str], deltas: list[torch.Tensor], bufs: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Average fragment `f`'s pseudo-gradients (and buffers) over the group."""
        with span(f"outer fragment {f}", COMM):
            avg = self.codec.average(f"fragment{f}", names, deltas, group=self._group)
            if bufs is not None:
                bufs.div_(world_size(self._group))
                wait(all_reduce(bufs, group=self._group, name=f"outer buffers {f}"))
        return avg, bufs

    def _land(self, f: int) -> None:
        pending = self._pending.pop(f)
        self._outer_step(f, *wait(pending.future))

    @torch.no_grad()
    def _outer_step(self, f: int, avg: list[torch.Tensor], bufs: torch.Tensor | None) -> None:
        """The outer step of fragment `f`, then the local copy follows the shared one."""
        idx = self.parts[f]
        for i, d in zip(idx, avg, strict=True):
            self.shared[i].grad = d.to(self.shared[i].dtype)
        self.outer[f].step()
        alpha = self.config.mix if self.config.delay else 0.0
        for i in idx:
            self.shared[i].grad = None
            local = self.params[i]
            if alpha == 0:
                local.copy_(self.shared[i])
            else:
                local.mul_(alpha).add_(self.shared[i], alpha=1 - alpha)
        if bufs is not None:
            for b, v in zip(self.buffers_of[f], unflatten(bufs, self.buffers_of[f]), strict=True):
                b.copy_(v)

    def flush(self) -> None:
        """Land every exchange in flight now (at the end of training)."""
        for f in sorted(self._pending, key=lambda f: self._pending[f].due):
            self._land(f)

    # ------------------------------------------------------------ the model
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def consensus(self) -> Iterator[None]:
        """The shared parameters in the model for the block (evaluation): every worker
        then holds the same model, the one training has agreed on so far."""
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shared, strict=True):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved, strict=True):
                    p.copy_(s)

    def close(self) -> None:
        """Land what is in flight, stop the communication thread and the step hooks."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            for h in self._handles:
                h.remove()
            if self.queue is not None:
                self.queue.close()

    # ---------------------------------------------------------- checkpoints
    def outer_state_dict(self) -> dict[str, Any]:
        """Everything beyond this worker's parameters that a resumed round needs: the
        schedule's clock, the shared copy, the outer optimizers, the error feedback, and
        the results of exchanges in flight (waited for, not applied: they still land on
        their own step)."""
        pending = {}
        for f, x in self._pending.items():
            avg, bufs = wait(x.future)
            done: torch.futures.Future[Any] = torch.futures.Future()
            done.set_result((avg, bufs))
            x.future = done
            pending[str(f)] = {"due": x.due, "avg": [a.clone() for a in avg], "buffers": bufs}
        return {
            "format": _STATE_FORMAT,
            "inner_steps": self.config.inner_steps,
            "fragments": self.config.fragments,
            "compression": self.config.compression.value,
            "rank": dist.get_rank(self._group),
            "world_size": world_size(self._group),
            "steps": self.steps,
            "shared": {n: s.clone() for n, s in zip(self.names, self.shared, strict=True)},
            "outer": [o.state_dict() for o in self.outer],
            "codec": self.codec.state_dict(),
            "pending": pending,
        }

    def load_outer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `outer_state_dict` output.

        Raises:
            ValueError: a state of another format, schedule, compression or model.
        """
        if state.get("format") != _STATE_FORMAT:
            raise ValueError("not a plait local-update state")
        for key in ("inner_steps", "fragments", "compression"):
            mine = getattr(self.config, key)
            mine = getattr(mine, "value", mine)
            if state.get(key) != mine:
                raise ValueError(
                    f"local-update state saved with {key}={state.get(key)!r}, this run uses "
                    f"{mine!r}"
                )
        shared = state["shared"]
        missing = sorted(set(self.names) - set(shared))
        if missing:
            raise ValueError(f"local-update state lacks the shared copy of {missing[:3]}")
        if (state.get("rank"), state.get("world_size")) != (
            dist.get_rank(self._group),
            world_size(self._group),
        ):
            logger.warning(
                "local-update state of rank %s of %s loaded on rank %d of %d: its error "
                "feedback is that rank's (save every rank's state for an exact resume)",
                state.get("rank"),
                state.get("world_size"),
                dist.get_rank(self._group),
                world_size(self._group),
            )
        with torch.no_grad():
            for n, s in zip(self.names, self.shared, strict=True):
                s.copy_(shared[n])
        for opt, saved in zip(self.outer, state["outer"], strict=True):
            opt.load_state_dict(saved)
        self.codec.load_state_dict(state["codec"])
        self.steps = int(state["steps"])
        self._pending = {}
        for f, x in state["pending"].items():
            done: torch.futures.Future[Any] = torch.futures.Future()
            done.set_result(([torch.as_tensor(a) for a in x["avg"]], x["buffers"]))
            self._pending[int(f)] = _Exchange(due=int(x["due"]), future=done)


def _save_state(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    assert isinstance(module, LocalUpdate)
    state_dict[prefix + STATE_KEY] = to_plain(module.outer_state_dict(), "local-update state")


def _load_state(  # noqa: PLR0917 - torch calls load pre-hooks positionally
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    saved = state_dict.pop(prefix + STATE_KEY, None)
    if saved is None:
        return
    assert isinstance(module, LocalUpdate)
    try:
        module.load_outer_state_dict(from_plain(saved))
    except (ValueError, KeyError, TypeError) as exc:
        error_msgs.append(f"cannot restore the local-update state: {exc}")
