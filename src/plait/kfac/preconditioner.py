"""`KFAC`: a distributed K-FAC preconditioner used beside any torch optimizer.

    model = plait.data_parallel(model, "ssgd")            # or any compressor, or plain DDP
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFAC(model, KFACConfig(inv_interval=10), optimizer=optimizer)
    ...
    loss.backward()
    precond.step(loss)      # gradients become (G (x) A)^-1 gradients
    optimizer.step()

Gradients are averaged by DDP (so every compressor works unchanged); the preconditioner
only adds the factors. Its hooks (`FactorCapture`) compute A in forward and G in backward
and hand each factor to the `FactorPipeline`, which fuses and all-reduces them while
forward/backward continue. `step` then decomposes the factors this worker was assigned
(`plait.kfac.placement`), exchanges the results, and applies the mode's rule to each
layer's gradient (`plait.kfac.eigenbasis`: K-FAC, EKFAC or Adam in the eigenbasis).

`KFAC` is the mechanism. Three policy objects are handed to it (or built from the config):
the `IntervalController` says which steps update and invert the factors, the
`PlacementProvider` says who inverts and who preconditions (asked again whenever the
decided intervals change), and `ProcessGroups` makes the process groups that placement
needs. Each can be built and tested without a process group.

Every hyper-parameter is a constant or a callable of the step (``damping=lambda s: ...``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm import ops
from plait.comm.stats import Collective
from plait.kfac.capture import FactorCapture, LayerBases
from plait.kfac.checks import check_value
from plait.kfac.config import KFACConfig
from plait.kfac.costs import KFACCosts
from plait.kfac.eigenbasis import EKFACRule, Mode, Moments, make_rule
from plait.kfac.factors import (
    Method,
    SecondOrder,
    decompose,
    explicit_form,
    kl_clip_scale,
    second_order_numel,
)
from plait.kfac.groups import ProcessGroups
from plait.kfac.intervals import IntervalController, Intervals, StepCosts, StepPlan, StepSample
from plait.kfac.layers import FACTORS, EmbeddingLayer, FactorKind, KFACLayer, make_layer
from plait.kfac.pipeline import FactorPipeline, FactorSync, PipelineConfig, Slot
from plait.kfac.placement import LOCAL, Assignment, Distribution, PlacementProvider, factor_key
from plait.trace import INVERSE, PRECONDITION, span

logger = logging.getLogger(__name__)

#: Layout of saved factors and decompositions. 2: factors packed in row bands
#: (`plait.kfac.triangle`), the inverse method's factors as Cholesky factors or inverses.
STATE_FORMAT = 2


@dataclass
class _Acc:
    """A factor being accumulated over the uses (and micro-batches) of one step."""

    total: torch.Tensor
    rows: int
    uses_now: int = 1
    last_s: float = 0.0


@dataclass
class _Pending:
    """A result still travelling: wait for `future`, then decode `buffer`."""

    future: torch.futures.Future[torch.Tensor]
    buffer: torch.Tensor
    damping: float = 0.0
    explicit: bool = False


@dataclass
class KFACStats:
    """Counters for reports and tests."""

    inversions: int = 0
    broadcasts: int = 0
    steps: int = 0
    replans: int = 0
    unhandled: list[str] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)
    batch_shared: list[str] = field(default_factory=list)


@dataclass
class LayerSelection:
    """What `select_layers` found: the layers to precondition and what is left alone."""

    layers: dict[str, KFACLayer]
    unhandled: Counter[str]
    examples: dict[str, str]
    shared: list[str]
    matrices: bool  # a weight matrix is among the modules left alone

    def no_layer_message(self, module: nn.Module) -> str:
        return (
            f"K-FAC found no layer to precondition in {type(module).__name__}: it "
            "handles nn.Linear, nn.Conv2d, nn.Embedding and transformers' Conv1D"
            + (f" (left alone: {', '.join(sorted(self.unhandled))})" if self.unhandled else "")
            + "; register a Linear-like layer with plait.kfac.register_layer_type"
        )


def select_layers(module: nn.Module, skip_layers: tuple[str, ...] = ()) -> LayerSelection:
    """The modules of `module` K-FAC preconditions, with no hook, group or timing.

    A parameter shared by two modules (tied input and output embeddings) is left to
    the optimizer: its Fisher block is the sum of one Kronecker product per use, and no
    single pair of factors represents that sum. Either module's pair alone would treat
    the other use's curvature as absent (and registering both would precondition one
    gradient twice and keep only the last result). The exact inverse of the sum needs
    decompositions of both vocabulary-sized sides, the very factor that makes an
    output-embedding K-FAC impractical; plain gradients for that one matrix are exact.
    """
    layers: dict[str, KFACLayer] = {}
    unhandled: Counter[str] = Counter()
    examples: dict[str, str] = {}
    matrices = False  # a weight matrix is among the modules left alone
    owners: dict[int, list[str]] = {}
    for name, sub in module.named_modules():
        params = [p for p in sub.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        for p in params:
            owners.setdefault(id(p), []).append(name or "<root>")
        cls = type(sub).__name__
        if any(fnmatch.fnmatch(name, pat) or fnmatch.fnmatch(cls, pat) for pat in skip_layers):
            continue
        layer = make_layer(name, sub)
        if layer is None:
            unhandled[cls] += 1
            examples.setdefault(cls, name or "<root>")
            matrices = matrices or any(p.dim() >= 2 for p in params)
            continue
        layers[name] = layer
    shared = sorted(
        {
            " & ".join(owners[id(p)])
            for layer in layers.values()
            for p in layer.parameters()
            if len(owners[id(p)]) > 1
        }
    )
    for group in shared:
        for name in group.split(" & "):
            layers.pop("" if name == "<root>" else name, None)
    return LayerSelection(
        layers=layers, unhandled=unhandled, examples=examples, shared=shared, matrices=matrices
    )


def check_model(model: nn.Module, config: KFACConfig | None = None) -> None:
    """Raise ValueError, naming the model, if K-FAC has no layer of it to precondition.

    Pure (no hook, process group or timing), so a launcher can call it in the parent
    process before any worker starts.
    """
    module = getattr(model, "module", model)
    if not isinstance(module, nn.Module):
        raise ValueError(f"KFAC expects an nn.Module, got {type(model).__name__}")
    sel = select_layers(module, (config or KFACConfig()).skip_layers)
    if not sel.layers:
        raise ValueError(sel.no_layer_message(module))


class KFAC:
    """Distributed K-FAC preconditioner; see the module docstring.

    Args:
        model: the model (a DDP wrapper is looked through).
        config: hyper-parameters and mechanics (defaults: SPD-KFAC's).
        optimizer: the optimizer whose learning rate KL clipping uses when `config.lr` is None.
        group: process group of the data-parallel workers (None: the default group).
        costs: the link and compute prices that placement and fusion are decided from
            (`KFACCosts`: measured, loaded from a file or given by hand). None measures
            them on the group at construction (collective; the links only when
            `config.probe`). Given costs make the construction free of timing, and on one
            process free of any collective.
        intervals: the interval policy (None: from the config, `KFACConfig.controller`).
        placement: the placement policy (None: from the config and `costs`).
        groups: the process groups (None: made from `group`); give one or the other.

    Raises:
        ValueError: invalid hyper-parameters, a model without a layer K-FAC supports,
            KL clipping without a learning rate, or both `group` and `groups`.
    """

    def __init__(
        self,
        model: nn.Module,
        config: KFACConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        group: Any = None,
        costs: KFACCosts | None = None,
        intervals: IntervalController | None = None,
        placement: PlacementProvider | None = None,
        groups: ProcessGroups | None = None,
    ) -> None:
        self.cfg = cfg = config or KFACConfig()
        self.optimizer = optimizer
        module = getattr(model, "module", model)
        if not isinstance(module, nn.Module):
            raise ValueError(f"KFAC expects an nn.Module, got {type(model).__name__}")
        if group is not None and groups is not None:
            raise ValueError("give KFAC a torch process group or ProcessGroups, not both")
        if costs is not None and not isinstance(costs, KFACCosts):
            raise ValueError(f"costs must be a KFACCosts, got {type(costs).__name__}")
        self.module = module
        self.stats = KFACStats()
        self.layers = self._register(module)
        self.groups = groups or ProcessGroups.of(group)
        self.world, self.rank = self.groups.world, self.groups.rank
        self.costs = costs or KFACCosts.measure(
            self.groups.group, method=cfg.decomposition, probe_links=cfg.probe
        )
        self.placement = placement or cfg.placement_provider(self.costs)
        self.controller = intervals or cfg.controller()
        self.pipeline = FactorPipeline(
            PipelineConfig(comm=cfg.comm, sync=cfg.sync, packed=cfg.packed,
                           comm_dtype=cfg.comm_dtype, bucket_cap_mb=cfg.bucket_cap_mb,
                           replan_every=cfg.replan_every),
            group=self.groups.group, cost=self.costs.link,
        )  # fmt: skip
        self.rule = make_rule(
            cfg.mode, graft=cfg.graft, scale_of=self._scale_of, rest_scale=cfg.rest_lr_scale,
            moments=Moments(beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps),
        )  # fmt: skip
        self.capture = FactorCapture(
            self.layers, self._add, packed=cfg.packed, approximation=cfg.approximation,
            active=lambda: self._plan(self.steps).factor, accept=self._accept,
            bases=self._bases if isinstance(self.rule, EKFACRule) else None,
            on_forward=self._forward_started,
        )  # fmt: skip
        self.assignment: Assignment | None = None
        self.distribution: Distribution | None = None
        self._planned_inv: int | None = None
        self.steps = 0
        self._plans: tuple[int, StepPlan] | None = None
        self._acc: dict[str, _Acc] = {}
        self._second: dict[str, SecondOrder] = {}
        self._pending: dict[str, _Pending] = {}
        self._inflight: list[torch.futures.Future[torch.Tensor]] = []
        self._ready: set[str] = set()  # layers with both decompositions (rank-consistent)
        self._micro = 0
        self._accumulating = False
        self._rest: list[nn.Parameter] | None = None  # SOAP: parameters outside the layers
        self._forward_began: float | None = None  # this step's first hooked forward
        self._inv_s = 0.0  # this step's inversions, with the waits for their broadcasts
        self.capture.attach()

    # ------------------------------------------------------------------ set-up
    def _register(self, module: nn.Module) -> dict[str, KFACLayer]:
        """The layers to precondition (`select_layers`); what is left alone is logged once.

        Raises:
            ValueError: no module of the model is one K-FAC can precondition.
        """
        sel = select_layers(module, self.cfg.skip_layers)
        if not sel.layers:
            raise ValueError(sel.no_layer_message(module))
        self.stats.unhandled = sorted(sel.unhandled)
        self.stats.shared = sel.shared
        if sel.unhandled or sel.shared:
            parts = [f"{cls} x{n} (e.g. {sel.examples[cls]})" for cls, n in sel.unhandled.items()]
            parts += [f"weight shared by {group}" for group in sel.shared]
            rest = " (Adam, in mode soap)" if self.cfg.mode is Mode.SOAP else ", unpreconditioned"
            logger.log(
                logging.WARNING if (sel.matrices or sel.shared) and not rest.startswith(" (")
                else logging.INFO,
                "K-FAC leaves these to the optimizer%s: %s", rest, ", ".join(parts),
            )  # fmt: skip
        return sel.layers

    def attach(self) -> None:
        """Install the factor hooks (done by the constructor; again after `remove`)."""
        self.capture.attach()

    def remove(self) -> None:
        """Detach the hooks (the model is left as it was; `attach` puts them back)."""
        self.capture.remove()

    # ------------------------------------------------------------------ schedule
    def at(self, name: str, step: int) -> Any:
        """Hyper-parameter `name` (a `KFACConfig` field) at `step`, validated; the
        intervals are those the interval controller has in force at `step`."""
        if name == "factor_interval":
            return self._plan(step).intervals.factor
        if name == "inv_interval":
            return self._plan(step).intervals.inv
        checks = {
            "damping": {"low": 0.0, "low_open": True},
            "factor_decay": {"low": 0.0, "high": 1.0},
            "kl_clip": {"low": 0.0, "low_open": True},
            "lr": {"low": 0.0},
        }
        return check_value(name, getattr(self.cfg, name), step, **checks.get(name, {}))

    @property
    def intervals(self) -> Intervals:
        """The intervals decided (outside probes; what placement is planned for)."""
        return self.controller.decided

    def _plan(self, step: int) -> StepPlan:
        if self._plans is None or self._plans[0] != step:
            self._plans = (step, self.controller.plan(step))
        return self._plans[1]

    def is_inversion_step(self, step: int) -> bool:
        """Whether `step` decomposes the factors."""
        return self._plan(step).inversion

    def _lr(self, step: int) -> float:
        if self.cfg.lr is not None:
            return float(self.at("lr", step))
        if self.optimizer is None:
            raise ValueError(
                "kl_clip needs the learning rate: set KFACConfig.lr or pass optimizer="
            )
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ contexts
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A micro-batch of gradient accumulation: factors accumulate, nothing is sent.

        The loss is assumed divided by the number of micro-batches (as plait's Trainer
        does); G is rescaled by its square so accumulated factors equal one big batch's.
        """
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False
            self._micro += 1
            for acc in self._acc.values():
                acc.uses_now = 0

    # ------------------------------------------------------------------ capture's sink
    def reduces(self, layer: KFACLayer) -> bool:
        """Whether `layer` forms its factors by K-FAC-reduce (`KFACConfig.approximation`)."""
        return self.capture.reduces(layer)

    def _forward_started(self) -> None:
        if self._forward_began is None:
            self._forward_began = time.perf_counter()

    def _accept(self, layer: KFACLayer, x: torch.Tensor) -> bool:
        """Leave a batch-shared embedding alone, on the step that discovers the factors."""
        if self.pipeline.discovered or not _shared_by_the_batch(layer, x):
            return True
        self.layers.pop(layer.name, None)
        for kind in FactorKind:
            self._acc.pop(factor_key(layer.name, kind), None)
        self.stats.batch_shared.append(layer.name)
        logger.warning(
            "K-FAC leaves %s to the optimizer: it is looked up once for the whole batch "
            "(input %s), so its output gradient arrives summed over the samples and its G "
            "factor would depend on how the batch is split among workers",
            layer.name, "x".join(map(str, x.shape)),
        )  # fmt: skip
        return False

    def _bases(self, layer: KFACLayer) -> LayerBases | None:
        assert isinstance(self.rule, EKFACRule)
        held = self.rule.basis(layer.name)
        if held is None:
            return None, None
        return held[0].basis, held[1].basis

    def _scale_of(self, name: str) -> torch.Tensor:
        return self.pipeline.factor_upper(factor_key(name, FactorKind.S))

    def _begin_pipeline_step(self) -> None:
        plan = self._plan(self.steps)
        communicate = plan.inversion if self.cfg.sync is FactorSync.LAZY else True
        decay = float(self.at("factor_decay", self.steps))
        self.pipeline.begin_step(communicate=communicate, decay=decay)

    def _add(self, layer: KFACLayer, kind: FactorKind, total: torch.Tensor, rows: int) -> None:
        """The capture's sink: sum over uses and micro-batches, then to the pipeline."""
        if kind is FactorKind.A and not self._accumulating and not self.pipeline.in_step:
            self._begin_pipeline_step()
        key = factor_key(layer.name, kind)
        acc = self._acc.get(key)
        if acc is None:
            self._acc[key] = acc = _Acc(total=total, rows=rows)
        else:
            acc.total.add_(total)
            acc.rows += rows
            acc.uses_now += 1
        acc.last_s = time.perf_counter()
        if self._accumulating or not self.pipeline.discovered or not self.pipeline.has(key):
            return
        if acc.uses_now >= self.pipeline.slot(key).uses:
            self._finalize(key, layer, kind)

    def _finalize(self, key: str, layer: KFACLayer, kind: FactorKind) -> None:
        acc = self._acc.pop(key)
        scale = 1.0 / max(acc.rows, 1)  # the mean, applied where the pipeline folds or copies
        if kind is not FactorKind.A and self._micro:  # G and S: squares of output gradients
            scale *= float(self._micro + 1) ** 2
        if not self.pipeline.in_step:
            self._begin_pipeline_step()
        self.pipeline.put(key, layer=layer.name, kind=kind, shape=layer.shape(kind),
                          wire=acc.total, uses=acc.uses_now, scale=scale)  # fmt: skip

    def _finalize_all(self) -> None:
        """Hand over what is left (all factors in the first step), in order of last use."""
        for key in sorted(self._acc, key=lambda k: self._acc[k].last_s):
            name, kind = key.rsplit("/", 1)
            self._finalize(key, self.layers[name], FactorKind(kind))

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Precondition the gradients in place; call after backward, before optimizer.step().

        Args:
            loss: this step's training loss on this worker, which ``"auto"`` intervals weigh
                against the time of each interval (None: time alone decides).
        """
        t = self.steps
        plan = self._plan(t)
        began, self._forward_began = self._forward_began, None
        entered = time.perf_counter()
        self._inv_s = 0.0
        self._finalize_all()
        lazy = self.cfg.sync is FactorSync.LAZY
        if (lazy and plan.inversion and self.world > 1 and self.pipeline.discovered
                and not self.pipeline.in_step):  # fmt: skip
            self.pipeline.begin_step(communicate=True, decay=1.0)
        if self.pipeline.in_step:
            self.pipeline.flush()
            self._ensure_placement(plan)
            if plan.inversion and self.cfg.overlap:
                for slots in self.pipeline.completed():
                    self._invert(slots, t)
            else:
                for _ in self.pipeline.completed():
                    pass
                if plan.inversion:
                    self._invert(self.pipeline.slots, t)
            self.pipeline.end_step()
        elif plan.inversion:
            self._ensure_placement(plan)
            self._invert(self.pipeline.slots, t)
        communicated_s = time.perf_counter() - entered - self._inv_s
        self._precondition(t, plan)
        self.steps += 1
        self.stats.steps += 1
        self._micro = 0
        hook_s, self.capture.seconds = self.capture.seconds, 0.0
        if began is not None and self.assignment is not None:
            # the step split into what every step pays and K-FAC's two amortisable parts;
            # lazy sync all-reduces the running factors only to invert them, so that wait
            # belongs to the inversion round (and factor updates between rounds are local)
            round_comm_s = communicated_s if lazy and plan.inversion else 0.0
            self.controller.observe(t, StepSample(
                total_s=time.perf_counter() - began,
                factor_s=hook_s + communicated_s - round_comm_s if plan.factor else None,
                inversion_s=self._inv_s + round_comm_s if plan.inversion else None,
                loss=None if loss is None else float(loss),
            ))  # fmt: skip
        if self.assignment is not None:
            self.controller.update(t, self._agree, self.step_costs)

    def _agree(self, values: list[float], op: str) -> list[float]:
        """The controller's numbers agreed over the ranks: the largest, or the mean."""
        if self.world <= 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        ops.all_reduce(t, group=self.groups.group, op=red, name="kfac intervals",
                       async_op=False)  # fmt: skip
        return (t if op == "max" else t / self.world).tolist()

    def step_costs(self, base_step_s: float) -> StepCosts:
        """The priced costs `"auto"` intervals fall back on before measuring: `base_step_s`,
        and from `self.costs` one all-reduce of every factor and one round of inversions
        (the placement's makespan plus the broadcasts of its results)."""
        comm_s = inv_s = 0.0
        if self.world > 1 and self.pipeline.discovered:
            comm_s = self.costs.link.time(
                Collective.ALL_REDUCE, self.pipeline.wire_bytes(), self.world
            )
        asg = self.assignment
        if asg is not None:
            inv_s = asg.makespan_s
            for s in self.pipeline.slots:
                owner = asg.inv_rank.get(s.key, LOCAL)
                workers = len(asg.inverse_group(s.layer)) if s.layer in asg.layer_rank else 1
                if owner == LOCAL or workers <= 1:
                    continue
                nbytes = 4 * second_order_numel(self.cfg.decomposition, s.shape,
                                                packed=self.cfg.packed)  # fmt: skip
                inv_s += self.costs.link.time(Collective.BROADCAST, nbytes, workers)
        return StepCosts(base_step_s=base_step_s, factor_s=comm_s, inversion_s=inv_s)

    # ------------------------------------------------------------------ placement
    def _ensure_placement(self, plan: StepPlan) -> None:
        """Plan placement at the first step, and again at the first inversion round after
        the decided inversion interval changed (rounds recompute every decomposition under
        the new placement; state held per layer moves to its new workers)."""
        if not self.pipeline.discovered:
            return
        inv = self.controller.decided.inv
        if self.assignment is not None and (inv == self._planned_inv or not plan.inversion):
            return
        layers = [
            layer
            for name, layer in self.layers.items()
            if all(self.pipeline.has(factor_key(name, kind)) for kind in FACTORS)
        ]
        placed = self.placement.plan(layers, world=self.world, inv_interval=inv)
        self.groups.ensure(placed.assignment.group_size)
        old, self.assignment = self.assignment, placed.assignment
        self.distribution, self._planned_inv = placed.distribution, inv
        if old is not None:
            self.stats.replans += 1
            logger.info("K-FAC placement re-planned for inversions every %d steps: %s", inv,
                        placed.distribution)  # fmt: skip
            self._move_states(old, placed.assignment)

    def _move_states(self, old: Assignment, new: Assignment) -> None:
        """Send each moved layer's rule state (SOAP's moments, grafting's) from a worker
        that held it to the workers that precondition the layer now: one all-reduce over
        the group, which every rank joins (the moved layers follow from the assignments)."""
        moved = [
            layer for name, layer in self.layers.items()
            if name in old.layer_rank and name in new.layer_rank
            and set(new.grad_workers(name)) - set(old.grad_workers(name))
        ]  # fmt: skip
        if not moved or self.world <= 1 or not self.rule.names:
            return
        sizes = [self.rule.layer_numel(layer) for layer in moved]
        buf = torch.zeros(sum(sizes), dtype=torch.float64)
        pos = 0
        for layer, n in zip(moved, sizes, strict=True):
            if self.rank == old.grad_workers(layer.name)[0]:
                buf[pos : pos + n] = self.rule.layer_state(layer)
            pos += n
        ops.all_reduce(buf, group=self.groups.group, name="kfac layer states", async_op=False)
        pos = 0
        for layer, n in zip(moved, sizes, strict=True):
            if self.rank in new.grad_workers(layer.name):
                self.rule.set_layer_state(layer, buf[pos : pos + n], self._dtype)
            pos += n

    # ------------------------------------------------------------------ inversions
    def _explicit(self, slot: Slot, step: int) -> bool:
        """Whether the inverse method keeps this factor as an explicit inverse
        (`factors.explicit_form`, from the inversion interval in force)."""
        other = FactorKind.G if slot.kind is FactorKind.A else FactorKind.A
        return explicit_form(
            self.cfg.inverse_form, self.cfg.decomposition, dim=slot.shape.dim,
            partner=self.layers[slot.layer].shape(other).dim,
            uses=self._plan(step).intervals.inv,
        )  # fmt: skip

    def _invert(self, slots: list[Slot], step: int) -> None:
        """Decompose this worker's share of `slots`; post or send the exchanges, in order."""
        asg = self.assignment
        if asg is None:
            return
        t0 = time.perf_counter()
        try:
            self._invert_slots(asg, slots, step)
        finally:
            self._inv_s += time.perf_counter() - t0

    def _invert_slots(self, asg: Assignment, slots: list[Slot], step: int) -> None:
        damping = float(self.at("damping", step))
        method = self.cfg.decomposition
        for s in slots:
            if s.key not in asg.inv_rank or not self.pipeline.is_initialized(s.key):
                continue
            owner = asg.inv_rank[s.key]
            workers = asg.inverse_group(s.layer)
            self._mark_ready(s.layer)
            if self.rank not in workers:
                continue
            explicit = self._explicit(s, step)
            if owner in (LOCAL, self.rank):
                so = self.decompose(s, step)
                self.stats.inversions += 1
                self._second[s.key] = so
                self._pending.pop(s.key, None)
                if owner == self.rank and len(workers) > 1:
                    wire = so.to_wire(packed=self.cfg.packed)
                    fut = self._broadcast(wire, owner, workers, f"inverse {s.key}")
                    self._inflight.append(fut)
                    self.stats.broadcasts += 1
            else:
                numel = second_order_numel(method, s.shape, packed=self.cfg.packed)
                buf = torch.empty(numel, dtype=self._dtype)
                fut = self._broadcast(buf, owner, workers, f"inverse {s.key}")
                self._pending[s.key] = _Pending(future=fut, buffer=buf, damping=damping,
                                                explicit=explicit)  # fmt: skip

    def _broadcast(
        self, t: torch.Tensor, src: int, ranks: tuple[int, ...], name: str
    ) -> torch.futures.Future[torch.Tensor]:
        """Broadcast `t` from group rank `src` to `ranks` (their group, made by `groups`)."""
        return ops.broadcast(
            t, src=self.groups.global_rank(src), group=self.groups.get(ranks), name=name
        )

    @property
    def _dtype(self) -> torch.dtype:
        running = self.pipeline.running
        return running.dtype if running is not None else torch.float32

    def decompose(self, slot: Slot, step: int) -> SecondOrder:
        """Decompose one factor's running average as `step` does; nothing is stored."""
        with span(f"inverse {slot.key}", INVERSE, n=slot.shape.dim):
            return decompose(
                self.pipeline.factor_upper(slot.key), slot.shape, method=self.cfg.decomposition,
                damping=float(self.at("damping", step)), packed=self.cfg.packed,
                explicit=self._explicit(slot, step),
            )  # fmt: skip

    def _mark_ready(self, layer: str) -> None:
        if all(self.pipeline.is_initialized(factor_key(layer, kind)) for kind in FACTORS):
            self._ready.add(layer)

    def _resolve(self, key: str) -> SecondOrder:
        pend = self._pending.pop(key, None)
        if pend is not None:
            t0 = time.perf_counter()
            ops.wait(pend.future)
            self._inv_s += time.perf_counter() - t0  # an inversion done elsewhere
            s = self.pipeline.slot(key)
            self._second[key] = SecondOrder.from_wire(
                pend.buffer, method=self.cfg.decomposition, shape=s.shape,
                damping=pend.damping, packed=self.cfg.packed, explicit=pend.explicit,
            )  # fmt: skip
        return self._second[key]

    def _held(self, name: str) -> tuple[SecondOrder, SecondOrder] | None:
        a = self._second.get(factor_key(name, FactorKind.A))
        g = self._second.get(factor_key(name, FactorKind.G))
        return None if a is None or g is None else (a, g)

    # ------------------------------------------------------------------ preconditioning
    def _precondition(self, step: int, plan: StepPlan) -> None:
        asg = self.assignment
        if asg is None:
            return
        damping = float(self.at("damping", step))
        # EKFAC's statistic was averaged over the workers on this step: every factor step
        # under eager sync, every round under lazy sync (on any world size alike)
        fresh = plan.inversion if self.cfg.sync is FactorSync.LAZY else plan.factor
        # In the model's layer order, on every rank: the broadcasts are issued alike, and the
        # KL clip sums over layers in an order that no timing-based placement can change.
        # Each entry: the layer, its new gradient (or the buffer a broadcast fills), the raw
        # gradient, and the broadcast to wait for (None: computed here).
        entries: list[tuple[KFACLayer, torch.Tensor, torch.Tensor, Any]] = []
        for name, layer in self.layers.items():
            if name not in asg.layer_rank or name not in self._ready:
                continue
            workers = asg.grad_workers(name)
            held = None
            if self.rank in workers:
                held = (
                    self._resolve(factor_key(name, FactorKind.A)),
                    self._resolve(factor_key(name, FactorKind.G)),
                )
                self.rule.refresh(name, *held)
                if fresh and isinstance(self.rule, EKFACRule):
                    self.rule.take_scale(name)
            grad = layer.grad_matrix()
            if grad is None:
                continue
            p: torch.Tensor | None = None
            if held is not None:
                with span(f"precondition {name}", PRECONDITION):
                    p = self.rule.direction(name, grad, *held,
                                            damping=damping).contiguous()  # fmt: skip
            if len(workers) == self.world:
                assert p is not None
                entries.append((layer, p, grad, None))
                continue
            src = asg.grad_source(name, self.rank)
            receivers = asg.receivers_of(src)
            if len(receivers) == 1:
                assert p is not None
                entries.append((layer, p, grad, None))
                continue
            buf = p if p is not None else torch.empty(grad.shape, dtype=grad.dtype)
            fut = self._broadcast(buf, src, receivers, f"gradient {name}")
            entries.append((layer, buf, grad, fut))
        for fut in self._inflight:
            ops.wait(fut)
        self._inflight.clear()
        for *_, fut in entries:
            if fut is not None:
                ops.wait(fut)
        self._write([(layer, p, grad) for layer, p, grad, _ in entries], step)
        self.rule.rest(self._rest_params())

    def _rest_params(self) -> list[nn.Parameter]:
        """The trainable parameters outside the preconditioned layers, in model order
        (fixed after the first step, when batch-shared layers have been left out)."""
        if self._rest is None:
            inside = {id(p) for layer in self.layers.values() for p in layer.parameters()}
            self._rest = [p for p in self.module.parameters()
                          if p.requires_grad and id(p) not in inside]  # fmt: skip
        return self._rest

    def _write(self, pairs: list[tuple[KFACLayer, torch.Tensor, torch.Tensor]], step: int) -> None:
        if not pairs:
            return
        with span("kl clip", PRECONDITION):
            if self.cfg.kl_clip is not None and self.rule.clips:
                scale = kl_clip_scale(
                    [(p, g) for _, p, g in pairs],
                    lr=self._lr(step),
                    kl_clip=float(self.at("kl_clip", step)),
                ).to(pairs[0][1].dtype)
                # in place: every direction here is this step's own tensor (a clipping
                # rule's product, or a broadcast's buffer), and one operator scales all
                torch._foreach_mul_([p for _, p, _ in pairs], scale)
            for layer, p, _ in pairs:
                layer.set_grad_matrix(p)

    @torch.no_grad()
    def dry_step(self) -> None:
        """What `step` computes on this worker, with no communication and no change of
        state: its decompositions (if the last step inverted) and its layers' new
        gradients (the trainer's compute-only reference times this)."""
        if self.assignment is None:
            return
        t = max(self.steps - 1, 0)
        if self.is_inversion_step(t):
            asg = self.assignment
            for s in self.pipeline.slots:
                if asg.inv_rank.get(s.key) in (LOCAL, self.rank) and (
                    self.pipeline.is_initialized(s.key)
                ):  # fmt: skip
                    self.decompose(s, t)
        damping = float(self.at("damping", t))
        pairs = []
        for name in self.assignment.layer_rank:
            held = self._held(name)
            if name not in self._ready or held is None or (
                self.rank not in self.assignment.grad_workers(name)
            ):  # fmt: skip
                continue
            layer = self.layers[name]
            grad = layer.grad_matrix()
            if grad is None or (
                isinstance(self.rule, EKFACRule) and name not in self.rule.snapshot
            ):
                continue
            with span(f"precondition {name}", PRECONDITION):
                p = self.rule.direction(name, grad, *held, damping=damping, update=False)
            pairs.append((layer, p, grad))
        self._write(pairs, t)
        self.rule.rest(self._rest_params(), update=False)

    # ------------------------------------------------------------------ state
    def state_dict(self, *, include_factors: bool = True) -> dict[str, Any]:
        """Step counter and settings; with `include_factors`, running factors, results and
        the mode's state (EKFAC's statistic, SOAP's moments).

        The state is this worker's own (factors under ``lazy`` sync and the decompositions
        a worker holds differ between workers): checkpoint it per rank.
        """
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "steps": self.steps,
            "config": self.cfg.constants(),
            "intervals": [self.intervals.factor, self.intervals.inv],
            "controller": self.controller.state_dict(),
            "pipeline": self.pipeline.state_dict(include_factors=include_factors),
        }
        if include_factors:
            for key in list(self._pending):
                self._resolve(key)
            state["second_order"] = {k: so.state() for k, so in self._second.items()}
            state["ready"] = sorted(self._ready)
            state["rule"] = self.rule.state_dict()
            if self.assignment is not None:
                state["assignment"] = {
                    "inv_rank": dict(self.assignment.inv_rank),
                    "layer_rank": dict(self.assignment.layer_rank),
                    "group_size": self.assignment.group_size,
                    "world": self.assignment.world,
                    "distribution": str(self.distribution),
                    "planned_inv": self._planned_inv,
                }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict` output (of the same model, world size and settings).

        Raises:
            ValueError: factors or decompositions saved in another format.
        """
        has_factors = "second_order" in state or "running" in state.get("pipeline", {})
        if has_factors and state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"checkpoint K-FAC factors are in format {state.get('format')}, this version "
                f"reads format {STATE_FORMAT}: resume with the version that wrote it, or "
                "from a state_dict(include_factors=False)"
            )
        self.steps = int(state["steps"])
        self.controller.load_state_dict(state.get("controller", {}))
        self.pipeline.load_state_dict(state.get("pipeline", {}))
        self._second.clear()
        self._pending.clear()
        self._ready.clear()
        for key, so in state.get("second_order", {}).items():
            s = self.pipeline.slot(key)
            self._second[key] = SecondOrder(
                method=Method(so["method"]), shape=s.shape, damping=float(so["damping"]),
                chol=so["chol"], inverse=so["inverse"], basis=so["basis"], values=so["values"],
            )  # fmt: skip
        self._ready.update(state.get("ready", []))
        if "rule" in state:
            self.rule.load_state_dict(state["rule"], layers=self.layers, held=self._held)
        asg = state.get("assignment")
        if asg is not None and asg["world"] == self.world:
            self.assignment = Assignment(
                world=asg["world"], group_size=asg["group_size"], inv_rank=dict(asg["inv_rank"]),
                layer_rank=dict(asg["layer_rank"]),
            )  # fmt: skip
            self.distribution = Distribution(asg["distribution"])
            self._planned_inv = asg.get("planned_inv")
            self.groups.ensure(self.assignment.group_size)
        else:
            self.assignment = None
            if self.pipeline.discovered:
                self._ensure_placement(self._plan(self.steps))


def _shared_by_the_batch(layer: KFACLayer, x: torch.Tensor) -> bool:
    """An embedding looked up with one row of several positions ([1, seq]): GPT-2's
    position embedding, whose output is broadcast over every sequence of the batch.

    Its hooks see only the batch-summed output gradient, never a sample's, so K-FAC's
    per-sample G factor cannot be formed. (A genuine per-worker batch of one sequence
    looks the same and is left alone too: the cost is one unpreconditioned embedding.)
    """
    return (
        isinstance(layer, EmbeddingLayer) and x.dim() >= 2 and x.shape[0] == 1 and (x.shape[1] > 1)
    )
