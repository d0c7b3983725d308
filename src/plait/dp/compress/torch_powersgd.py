"""PyTorch's own `powerSGD_hook`, configured so that it runs on gloo: a baseline.

PyTorch's hook issues its P and Q all-reduces from future callbacks. On gloo that crashes
("collective mismatch") as soon as DDP has two buckets in flight, because the callbacks
run on whichever thread finished the previous collective and ranks disagree on the order.
This compressor therefore sets `single_bucket`: `plait.data_parallel` gives DDP ONE
bucket, so the hook runs once, after backward has finished, and its three all-reduces
(uncompressed tensors, P, Q) follow each other on every rank in the same order. The price
is the overlap with backward, which is exactly what the other compressors keep. It also
talks on a process group of its own, so DDP's unused-parameter all-reduce cannot
interleave with the callbacks' collectives.

PyTorch runs plain all-reduce for the first `warmup` (>= 2) steps while DDP rebuilds its
buckets, and keys its state by bucket. Here the state is re-keyed by parameter name for
checkpoints, and re-laid out when a resumed DDP hands over its first, differently ordered
bucket, so a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from plait.comm import Collective, world_size
from plait.comm import stats as comm_stats
from plait.comm.ops import collective_error
from plait.dp.compress.base import Compressor, check_positive
from plait.dp.compress.lowrank import matrix_shape
from plait.dp.compress.powersgd import duplicate_group
from plait.trace import COMM, tracer

_Segments = dict[str, dict[str, tuple[int, int]]]  # name -> part -> (offset, numel)


class TorchPowerSGD(Compressor):
    """`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook` on a single bucket.

    Args:
        group: process group.
        rank: matrix approximation rank, > 0.
        min_compression_rate: as PyTorch's option of that name.
        warmup: PyTorch's `start_powerSGD_iter`; it needs >= 2.
        seed: PyTorch's `random_seed` for the initial Q.
        batch_same_shape: PyTorch's `batch_tensors_with_same_shape`.
    """

    name = "torch-powersgd"
    single_bucket = True

    def __init__(
        self,
        *,
        group: Any = None,
        rank: int = 4,
        min_compression_rate: float = 2.0,
        warmup: int = 2,
        seed: int = 0,
        batch_same_shape: bool = False,
    ) -> None:
        super().__init__(group=group)
        check_positive("rank", rank, integer=True)
        check_positive("min_compression_rate", min_compression_rate)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 2:
            raise ValueError(f"torch-powersgd needs warmup >= 2 (PyTorch's rule), got {warmup!r}")
        self.rank = rank
        self.min_compression_rate = min_compression_rate
        self.warmup = warmup
        self.seed = seed
        self.batch_same_shape = batch_same_shape
        self._state: torch_psgd.PowerSGDState | None = None
        self._layout: list[str] = []
        self._shapes: list[torch.Size] = []
        self._pending: dict[str, dict[str, torch.Tensor]] | None = None

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self._ensure_state()
        super().register(ddp)

    def _ensure_state(self) -> torch_psgd.PowerSGDState:
        if self._state is None:
            self._state = torch_psgd.PowerSGDState(
                process_group=duplicate_group(self.group),
                matrix_approximation_rank=self.rank,
                start_powerSGD_iter=self.warmup,
                min_compression_rate=self.min_compression_rate,
                use_error_feedback=True,
                warm_start=True,
                random_seed=self.seed,
                compression_stats_logging_frequency=2**62,
                batch_tensors_with_same_shape=self.batch_same_shape,
            )
        return self._state

    def hook(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if bucket.index() != 0:
            raise ValueError(
                "torch-powersgd needs all gradients in one DDP bucket (PyTorch's hook breaks "
                "on gloo with several); wrap the model with plait.data_parallel"
            )
        state = self._ensure_state()
        grads = bucket.gradients()
        layout = [self.param_name(p) for p in bucket.parameters()]
        if layout != self._layout:
            self._relayout(layout, grads)
        self._count(state, grads)
        start = tracer.now_us()
        fut = torch_psgd.powerSGD_hook(state, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            tracer.add("torch powerSGD_hook", COMM, start, tracer.now_us())
            try:
                return f.value()
            except Exception as exc:  # PyTorch's hook bypasses plait.comm: describe it here
                raise collective_error(
                    Collective.ALL_REDUCE, "torch powerSGD_hook", state.process_group, exc
                ) from exc

        return fut.then(done)

    # ------------------------------------------------------------- byte counts
    def _compressed(self, shape: Sequence[int]) -> int:
        """PyTorch's rank for a tensor of `shape`, 0 when it travels uncompressed."""
        n, m = matrix_shape(shape) if len(shape) else (1, 1)
        r = min(n, m, self.rank)
        ok, _, _ = torch_psgd._should_compress(n, m, r, self.min_compression_rate)
        return r if ok else 0

    def _count(self, state: torch_psgd.PowerSGDState, grads: Sequence[torch.Tensor]) -> None:
        """Record the all-reduces PyTorch's hook is about to issue (it bypasses plait.comm)."""
        p = world_size(state.process_group)
        if p == 1:
            return
        size = grads[0].element_size() if grads else 4
        if state.iter < state.start_powerSGD_iter:
            comm_stats.add(Collective.ALL_REDUCE, sum(g.numel() for g in grads) * size, p)
            return
        dense = ps = qs = 0
        for g in grads:
            r = self._compressed(g.shape)
            if r:
                n, m = matrix_shape(g.shape)
                ps += n * r
                qs += m * r
            else:
                dense += g.numel()
        for numel in (dense, ps, qs):
            comm_stats.add(Collective.ALL_REDUCE, numel * size, p)

    # ---------------------------------------------------------- state layouts
    def _segments(self, names: Sequence[str], shapes: Sequence[torch.Size]) -> _Segments:
        """Where each parameter's error, P and Q sit in PyTorch's flat per-bucket state."""
        out: _Segments = {}
        off = 0
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
            numel = shape.numel()
            out[name] = {"error": (off, numel)}
            off += numel
            if self._compressed(shape):
                by_shape.setdefault(matrix_shape(shape), []).append(i)
        p_off = q_off = 0
        for (n, m), members in by_shape.items():  # PyTorch's order: shapes first seen first
            r = min(n, m, self.rank)
            for i in members:
                out[names[i]]["p"] = (p_off, n * r)
                out[names[i]]["q"] = (q_off, m * r)
                p_off += n * r
                q_off += m * r
        return out

    def _per_param(self) -> dict[str, dict[str, torch.Tensor]]:
        """PyTorch's flat state split by parameter name (copies)."""
        state = self._state
        if state is None or 0 not in state.error_dict:
            return {}
        flat = {"error": state.error_dict[0]}
        if 0 in state.q_memory_dict:
            flat["q"] = state.q_memory_dict[0]
            flat["p"] = state.p_memory_dict[0]
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, parts in self._segments(self._layout, self._shapes).items():
            out[name] = {
                part: flat[part][o : o + n].clone()
                for part, (o, n) in parts.items()
                if part in flat
            }
        return out

    def _relayout(self, layout: list[str], grads: Sequence[torch.Tensor]) -> None:
        """Adopt a new bucket layout, moving PyTorch's flat state along (or loading it)."""
        per_param = self._pending if self._pending is not None else self._per_param()
        self._pending = None
        self._layout = layout
        self._shapes = [g.shape for g in grads]
        state = self._ensure_state()
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        if not per_param:
            return
        missing = set(layout) - set(per_param)
        if missing:
            raise ValueError(f"torch-powersgd state lacks parameters {sorted(missing)[:5]}")
        dtype = grads[0].dtype
        segs = self._segments(layout, self._shapes)
        sizes = {part: 0 for part in ("error", "p", "q")}
        for parts in segs.values():
            for part, (o, n) in parts.items():
                sizes[part] = max(sizes[part], o + n)
        flat = {
            part: torch.zeros(n, dtype=dtype, device=grads[0].device) for part, n in sizes.items()
        }
        for name, parts in segs.items():
            for part, (o, n) in parts.items():
                saved = per_param[name].get(part)
                if saved is not None:
                    if saved.numel() != n:
                        raise ValueError(f"torch-powersgd state of {name!r} {part} has wrong size")
                    flat[part][o : o + n].copy_(saved.reshape(-1))
        state.error_dict[0] = flat["error"]
        if all("q" in per_param[n] for n, parts in segs.items() if "q" in parts):
            state.p_memory_dict[0] = flat["p"]
            state.q_memory_dict[0] = flat["q"]

    def state_dict(self) -> dict[str, Any]:
        state = self._ensure_state()
        return {
            "iter": state.iter,
            "rng": state.rng.get_state(),
            "params": self._pending if self._pending is not None else self._per_param(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"iter", "rng", "params"} - set(state)
        if missing:
            raise ValueError(f"torch-powersgd state lacks {sorted(missing)}")
        s = self._ensure_state()
        s.iter = int(state["iter"])
        s.rng.set_state(state["rng"])
        self._pending = dict(state["params"])
        self._layout = []  # the next hook lays the loaded state out
