"""The factor communication pipeline: running-average storage, fusion and all-reduces.

Every worker computes Kronecker factors of its own shard; their mean over workers is the
factor of the whole batch. This module stores the running averages of all factors in one
flat buffer laid out in the order the factors become ready during forward/backward, so a
fusion bucket is a contiguous slice and is all-reduced in place, without copies. When a
bucket's collective is issued is the difference between the strategies:

- ``after-backward`` (textbook distributed K-FAC): one all-reduce per factor, all issued
  after backward;
- ``static`` (KAISA): buckets of a fixed byte threshold, each issued from the hook that
  completes it;
- ``dynamic`` (SPD-KFAC): buckets planned by `plait.comm.ReadyTimePlanner` from measured
  ready times and the alpha-beta model, issued from the hook that completes them, and
  re-planned when the ready times drift.

Collectives are issued from the forward/backward hooks, which run in the same order on every
rank, on a process group of their own, so the order is the same everywhere (gloo's rule)
and DDP's gradient buckets travel independently.

Two synchronisation modes give the same factors (the running average is linear, so the
mean of per-worker running averages is the running average of the means):
``eager`` all-reduces each step's batch factors and folds the mean into the average;
``lazy`` keeps a per-worker running average and all-reduces it only at steps that invert,
so steps between inversions send no factor bytes at all.

The first step that computes factors discovers them (which modules' hooks fire, in which
order, how often): it communicates everything after backward, and the layout and plan are
built from what it saw. Modules whose hooks never fire are simply absent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from plait.comm import ops
from plait.comm.cost import AlphaBeta
from plait.comm.fusion import BucketPlan, FusionItem, ReadyTimePlanner, ThresholdPlanner, check_plan
from plait.kfac.factors import WireLayout
from plait.kfac.layers import FactorKind, FactorShape


class FactorComm(StrEnum):
    """When factor all-reduces are issued and how they are fused."""

    AFTER_BACKWARD = "after-backward"
    STATIC = "static"
    DYNAMIC = "dynamic"


class FactorSync(StrEnum):
    """Which factors travel: every step's batch factors, or running averages when needed."""

    EAGER = "eager"
    LAZY = "lazy"


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Factor communication settings.

    Attributes:
        comm: after-backward, static or dynamic (see the module docstring).
        sync: eager or lazy.
        packed: send symmetric factors as upper triangles (half the bytes).
        comm_dtype: send factors in this dtype (float16/bfloat16 halve the bytes again);
            None keeps the factors' dtype. Averages and decompositions stay in full precision.
        bucket_cap_mb: threshold of static buckets, MB.
        replan_every: communicating steps between drift checks of the dynamic plan.
        drift: re-plan when a ready time moved by more than this fraction of the step.
    """

    comm: FactorComm = FactorComm.DYNAMIC
    sync: FactorSync = FactorSync.EAGER
    packed: bool = True
    comm_dtype: torch.dtype | None = None
    bucket_cap_mb: float = 25.0
    replan_every: int = 10
    drift: float = 0.1

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.replan_every < 1:
            raise ValueError(f"replan_every must be >= 1, got {self.replan_every}")
        if self.drift <= 0:
            raise ValueError(f"drift must be > 0, got {self.drift}")


@dataclass(frozen=True, kw_only=True)
class Slot:
    """A factor's place in the flat buffers."""

    index: int
    key: str
    layer: str
    kind: FactorKind
    shape: FactorShape
    offset: int
    numel: int
    uses: int


@dataclass
class _Bucket:
    index: int
    slots: list[int]
    start: int
    end: int
    pending: int = 0
    future: torch.futures.Future[torch.Tensor] | None = None
    wire: torch.Tensor | None = None
    issued: bool = False


@dataclass(frozen=True, kw_only=True)
class _Found:
    """A factor seen during discovery."""

    key: str
    layer: str
    kind: FactorKind
    shape: FactorShape
    wire: torch.Tensor
    uses: int
    ready_s: float


@dataclass
class _StepState:
    communicate: bool
    decay: float
    t0: float
    fired: set[int] = field(default_factory=set)
    ready_s: dict[int, float] = field(default_factory=dict)
    next_bucket: int = 0


def bucket_plan(
    config: PipelineConfig, items: list[FusionItem], *, cost: AlphaBeta, world: int
) -> BucketPlan:
    """The buckets `config.comm` makes of the factors `items` (in ready order).

    A pure function of its arguments, so every rank that agrees on the ready times makes
    the same plan, and the decision can be checked for any link and world size by hand.
    """
    if config.comm is FactorComm.AFTER_BACKWARD:
        plan: BucketPlan = [[i] for i in range(len(items))]
    elif config.comm is FactorComm.STATIC:
        plan = ThresholdPlanner(threshold_bytes=int(config.bucket_cap_mb * 1e6)).plan(items)
    else:
        plan = ReadyTimePlanner(cost=cost, world=world).plan(items)
    check_plan(plan, len(items))
    return plan


class FactorPipeline:
    """Storage, fusion and communication of one model's factors; see the module docstring.

    Args:
        config: the pipeline settings.
        group: the process group of the factor collectives (None: no communication).
        cost: alpha-beta model of `group`'s links (the dynamic planner's prices).
    """

    def __init__(
        self, config: PipelineConfig, *, group: Any = None, cost: AlphaBeta | None = None
    ) -> None:
        self.cfg = config
        self.group = group
        self.world = ops.world_size(group) if group is not None else 1
        self.cost = cost or AlphaBeta.from_rate(1e9)
        self.layout = WireLayout(packed=config.packed)
        self.slots: list[Slot] = []
        self._index: dict[str, int] = {}
        self.running: torch.Tensor | None = None
        self._batch: torch.Tensor | None = None
        self.initialized: list[bool] | None = None  # per slot (a list: read per factor)
        self.plan: BucketPlan = []
        self._buckets: list[_Bucket] = []
        self._bucket_of: list[int] = []
        self.ready_est: list[float] = []
        self._planned_ready: list[float] = []
        self.comm_steps = 0
        self.replans = 0
        self._step: _StepState | None = None
        self._discovery: list[_Found] = []

    # ------------------------------------------------------------------ queries
    @property
    def discovered(self) -> bool:
        return self.running is not None

    def has(self, key: str) -> bool:
        return key in self._index

    def slot(self, key: str) -> Slot:
        return self.slots[self._index[key]]

    def is_initialized(self, key: str) -> bool:
        return (
            self.initialized is not None
            and key in self._index
            and self.initialized[self._index[key]]
        )

    def factor_upper(self, key: str) -> torch.Tensor:
        """The running average as a matrix whose upper triangle holds it (or a diagonal)."""
        s = self.slot(key)
        assert self.running is not None
        return self.layout.upper(self.running[s.offset : s.offset + s.numel], s.shape)

    def wire_bytes(self) -> int:
        """Bytes of one full exchange of all factors (payload, before the ring's factor)."""
        return sum(s.numel for s in self.slots) * self._wire_elem

    @property
    def _wire_elem(self) -> int:
        dtype = self.cfg.comm_dtype or (
            self.running.dtype if self.running is not None else torch.float32
        )
        return torch.empty((), dtype=dtype).element_size()

    @property
    def in_step(self) -> bool:
        return self._step is not None

    # ------------------------------------------------------------------ step protocol
    def begin_step(self, *, communicate: bool, decay: float) -> None:
        """Start a step that updates factors; `communicate`: this step exchanges them."""
        assert self._step is None, "begin_step twice without end_step"
        self._step = _StepState(communicate=communicate and self.world > 1, decay=decay,
                                t0=time.perf_counter())  # fmt: skip
        for b in self._buckets:
            b.pending = len(b.slots)
            b.issued = False
            b.future = None
            b.wire = None

    def put(
        self, key: str, *, layer: str, kind: FactorKind, shape: FactorShape, wire: torch.Tensor,
        uses: int = 1, scale: float = 1.0,
    ) -> None:  # fmt: skip
        """Hand over a finished factor of this step, flat in this pipeline's wire layout
        (`WireLayout.numel` elements): ``wire * scale`` is the mean over this worker's rows
        (the scale rides on the fold or the copy that follows, not an operator of its own).

        Called from the forward/backward hooks; may issue the bucket it completes.
        """
        st = self._step
        assert st is not None, "put outside a step"
        if not self.discovered:
            wire = wire if scale == 1.0 else wire * scale
            self._discovery.append(_Found(key=key, layer=layer, kind=kind, shape=shape,
                                          wire=wire, uses=uses,
                                          ready_s=time.perf_counter() - st.t0))  # fmt: skip
            return
        i = self._index.get(key)
        if i is None:  # appeared after discovery: not part of the layout
            return
        s = self.slots[i]
        assert self.running is not None and self.initialized is not None
        assert wire.numel() == s.numel, f"{key}: {wire.numel()} wire elements, slot {s.numel}"
        region = slice(s.offset, s.offset + s.numel)
        if self.cfg.sync is FactorSync.LAZY or not st.communicate:
            self._fold(i, wire, st.decay, scale)
        else:
            assert self._batch is not None
            torch.mul(wire, scale / self.world, out=self._batch[region])
        st.fired.add(i)
        if st.communicate:
            st.ready_s[i] = time.perf_counter() - st.t0
            b = self._buckets[self._bucket_of[i]]
            b.pending -= 1
            if self.cfg.comm is not FactorComm.AFTER_BACKWARD:
                self._issue_ready(st)

    def _fold(self, i: int, wire: torch.Tensor, decay: float, scale: float = 1.0) -> None:
        """running <- decay * running + (1 - decay) * scale * wire (or scale * wire, the
        first time)."""
        s = self.slots[i]
        assert self.running is not None and self.initialized is not None
        dst = self.running[s.offset : s.offset + s.numel]
        if self.initialized[i]:
            dst.mul_(decay).add_(wire, alpha=(1.0 - decay) * scale)
        else:
            torch.mul(wire, scale, out=dst)  # a copy, bit for bit, when scale is 1
            self.initialized[i] = True

    def _issue_ready(self, st: _StepState) -> None:
        while st.next_bucket < len(self._buckets):
            b = self._buckets[st.next_bucket]
            if b.pending > 0:
                return
            self._issue(b)
            st.next_bucket += 1

    def _issue(self, b: _Bucket) -> None:
        assert self.running is not None
        if self.cfg.sync is FactorSync.LAZY:
            src = self.running[b.start : b.end]
            src.div_(self.world)
        else:
            assert self._batch is not None
            src = self._batch[b.start : b.end]
        wire = src
        if self.cfg.comm_dtype is not None and self.cfg.comm_dtype != src.dtype:
            wire = src.to(self.cfg.comm_dtype)
        b.wire = wire
        b.future = ops.all_reduce(wire, group=self.group, name=f"factors b{b.index}")
        b.issued = True

    def flush(self) -> None:
        """Issue every bucket not yet issued (all of them for after-backward), in order."""
        st = self._step
        if st is None:
            return
        if not self.discovered:
            self._discover()
        if not st.communicate:
            return
        while st.next_bucket < len(self._buckets):
            self._issue(self._buckets[st.next_bucket])
            st.next_bucket += 1

    def completed(self) -> Iterator[list[Slot]]:
        """Wait for the buckets in order; yield each bucket's slots once averaged and folded."""
        st = self._step
        if st is None:
            return
        if not self.discovered:
            self._discover()
        if not st.communicate:
            yield list(self.slots)
            return
        self.flush()
        for b in self._buckets:
            if b.future is None:
                continue
            ops.wait(b.future)
            assert self.running is not None
            dst = self.running if self.cfg.sync is FactorSync.LAZY else self._batch
            assert dst is not None
            if b.wire is not None and b.wire.data_ptr() != dst[b.start : b.end].data_ptr():
                dst[b.start : b.end].copy_(b.wire)
            if self.cfg.sync is FactorSync.EAGER:
                for i in b.slots:
                    if i in st.fired:
                        s = self.slots[i]
                        self._fold(i, dst[s.offset : s.offset + s.numel], st.decay)
            b.future = None
            b.wire = None
            yield [self.slots[i] for i in b.slots]

    def end_step(self) -> None:
        """Finish the step: record ready times and re-plan when they drifted."""
        st = self._step
        self._step = None
        if st is None or not st.communicate or not self.discovered:
            return
        self.comm_steps += 1
        for i, t in st.ready_s.items():
            self.ready_est[i] = 0.5 * self.ready_est[i] + 0.5 * t
        if self.cfg.comm is FactorComm.DYNAMIC and self._check_due():
            agreed = self._agree(self.ready_est)
            span = max(max(agreed, default=0.0), 1e-6)
            moved = max(
                (abs(a - b) for a, b in zip(agreed, self._planned_ready, strict=True)), default=0.0
            )
            if moved > self.cfg.drift * span:
                self._make_plan(agreed)
                self.replans += 1

    def _check_due(self) -> bool:
        n = self.comm_steps
        return n <= 3 or n % self.cfg.replan_every == 0

    # ------------------------------------------------------------------ discovery
    def _discover(self) -> None:
        """Lay out and plan what the first step saw, then take its factors in."""
        st = self._step
        assert st is not None
        found = self._discovery
        if self.world > 1:
            self._check_layout([f.key for f in found])
        offset = 0
        for pos, f in enumerate(found):
            numel = self.layout.numel(f.shape)
            self.slots.append(Slot(index=pos, key=f.key, layer=f.layer, kind=f.kind,
                                   shape=f.shape, offset=offset, numel=numel,
                                   uses=f.uses))  # fmt: skip
            self._index[f.key] = pos
            offset += numel
        dtype = found[0].wire.dtype if found else torch.float32
        device = found[0].wire.device if found else torch.device("cpu")
        self.running = torch.zeros(offset, dtype=dtype, device=device)
        if self.cfg.sync is FactorSync.EAGER and self.world > 1:
            self._batch = torch.zeros(offset, dtype=dtype, device=device)
        self.initialized = [False] * len(self.slots)
        self.ready_est = self._agree([f.ready_s for f in found])
        self._make_plan(self.ready_est)
        for b in self._buckets:
            b.pending = 0
        for i, f in enumerate(found):
            wire = f.wire
            if self.cfg.sync is FactorSync.LAZY or not st.communicate:
                self._fold(i, wire, st.decay)
            else:
                assert self._batch is not None
                s = self.slots[i]
                torch.div(wire, self.world, out=self._batch[s.offset : s.offset + s.numel])
            st.fired.add(i)
        self._discovery = []

    def _check_layout(self, keys: list[str]) -> None:
        """Every rank must have seen the same factors in the same order (gloo pairs by order)."""
        checksum = 0
        for pos, key in enumerate(keys):
            checksum = (checksum * 1_000_003 + sum(map(ord, key)) * (pos + 1)) % 2_147_483_647
        mine = [float(len(keys)), float(checksum)]
        both = ops.reduce_floats(
            mine + [-v for v in mine], op="max", group=self.group, name="kfac layout"
        )
        if both[:2] != mine or [-v for v in both[2:]] != mine:
            raise RuntimeError(
                "K-FAC hooks fired on different modules or in a different order on different "
                "ranks; every rank must run the same model code"
            )

    def _agree(self, values: list[float]) -> list[float]:
        """The mean over ranks, so that every rank plans from the same numbers."""
        return ops.reduce_floats(values, op="mean", group=self.group, name="kfac agree")

    # ------------------------------------------------------------------ planning
    def items(self, ready_s: list[float] | None = None) -> list[FusionItem]:
        times = ready_s if ready_s is not None else self.ready_est
        elem = self._wire_elem
        return [
            FusionItem(name=s.key, nbytes=s.numel * elem, ready_s=times[s.index])
            for s in self.slots
        ]

    def _make_plan(self, ready_s: list[float]) -> None:
        plan = bucket_plan(self.cfg, self.items(ready_s), cost=self.cost, world=self.world)
        self.plan = plan
        self._planned_ready = list(ready_s)
        self._buckets = []
        self._bucket_of = [0] * len(self.slots)
        for bi, idx in enumerate(plan):
            first, last = self.slots[idx[0]], self.slots[idx[-1]]
            self._buckets.append(_Bucket(index=bi, slots=list(idx), start=first.offset,
                                         end=last.offset + last.numel))  # fmt: skip
            for i in idx:
                self._bucket_of[i] = bi

    # ------------------------------------------------------------------ state
    def state_dict(self, *, include_factors: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = {
            "slots": [
                {
                    "key": s.key,
                    "layer": s.layer,
                    "kind": str(s.kind),
                    "dim": s.shape.dim,
                    "groups": s.shape.groups,
                    "diagonal": s.shape.diagonal,
                    "cols": s.shape.cols,
                    "uses": s.uses,
                }
                for s in self.slots
            ],
            "ready_est": list(self.ready_est),
            "planned_ready": list(self._planned_ready),
            "comm_steps": self.comm_steps,
            "packed": self.cfg.packed,
        }
        if include_factors and self.running is not None:
            state["running"] = self.running.clone()
            state["initialized"] = (
                None if self.initialized is None
                else torch.tensor(self.initialized, dtype=torch.bool)
            )  # fmt: skip
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("slots"):
            return
        if bool(state.get("packed", self.cfg.packed)) != self.cfg.packed:
            raise ValueError("checkpoint factors were stored with another packing setting")
        self.slots.clear()
        self._index.clear()
        offset = 0
        for pos, d in enumerate(state["slots"]):
            shape = FactorShape(dim=d["dim"], groups=d["groups"], diagonal=d["diagonal"],
                                cols=d.get("cols"))  # fmt: skip
            numel = self.layout.numel(shape)
            self.slots.append(Slot(index=pos, key=d["key"], layer=d["layer"],
                                   kind=FactorKind(d["kind"]), shape=shape, offset=offset,
                                   numel=numel, uses=d["uses"]))  # fmt: skip
            self._index[d["key"]] = pos
            offset += numel
        running = state.get("running")
        dtype = running.dtype if running is not None else torch.float32
        self.running = running.clone() if running is not None else torch.zeros(offset, dtype=dtype)
        if self.cfg.sync is FactorSync.EAGER and self.world > 1:
            self._batch = torch.zeros(offset, dtype=dtype)
        init = state.get("initialized")
        self.initialized = (
            [bool(v) for v in init.tolist()] if init is not None else [False] * len(self.slots)
        )
        self.ready_est = list(state.get("ready_est", [0.0] * len(self.slots)))
        self.comm_steps = int(state.get("comm_steps", 0))
        self._make_plan(list(state.get("planned_ready", self.ready_est)))
