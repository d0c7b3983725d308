"""`KFAC`: a distributed K-FAC preconditioner used beside any torch optimizer.

    model = plait.data_parallel(model, "ssgd")            # or any compressor, or plain DDP
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFAC(model, KFACConfig(inv_interval=10), optimizer=optimizer)
    ...
    loss.backward()
    precond.step()          # gradients become (G (x) A)^-1 gradients
    optimizer.step()

Gradients are averaged by DDP (so every compressor works unchanged); the preconditioner
only adds the factors. Forward hooks compute A, tensor hooks on the layer outputs compute G,
and both hand their factor to the `FactorPipeline`, which fuses and all-reduces them while
forward/backward continue. `step` then inverts the factors this worker was assigned
(`plait.kfac.placement`), exchanges the results, and preconditions.

Every hyper-parameter is a constant or a callable of the step (``damping=lambda s: ...``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
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
from plait.distributed import new_group
from plait.kfac.config import KFACConfig, check_value
from plait.kfac.costs import KFACCosts
from plait.kfac.factors import (
    InverseForm,
    Method,
    SecondOrder,
    decompose,
    kl_clip_scale,
    precondition,
    second_order_numel,
)
from plait.kfac.intervals import (
    AUTO,
    PROBE_ROUNDS,
    WARMUP_STEPS,
    IntervalPlanner,
    Intervals,
    StepCosts,
    probe_intervals,
)
from plait.kfac.layers import (
    Approximation,
    Conv2dLayer,
    EmbeddingLayer,
    FactorKind,
    KFACLayer,
    make_layer,
)
from plait.kfac.pipeline import FactorComm, FactorPipeline, FactorSync, PipelineConfig, Slot
from plait.kfac.placement import (
    LOCAL,
    Assignment,
    Distribution,
    PlacementPolicy,
    factor_key,
    plan_placement,
)
from plait.trace import FACTOR, INVERSE, PRECONDITION, span

logger = logging.getLogger(__name__)

#: An explicit inverse of side n pays once ``uses * m >= EXPLICIT_PAYOFF * n`` (m: the partner
#: side it is multiplied with). From the per-layer kernel tables on one core
#: (benchmarks/kfac/kernels-*, A and G timed together), the break-even ratio is 0.4-0.8 for
#: ResNet-18's layers up to 1152 wide, about 1 for the GPT's, and 1-2 for ResNet-18's
#: 2304-4608 wide ones. 0.7 fits the narrow layers and leans to the explicit form for the
#: widest: a 4608 factor reused 7 to 18 times gets the explicit form although the Cholesky
#: one would be cheaper (by up to about 15% of the decompositions and solves).
EXPLICIT_PAYOFF = 0.7

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

    Raises:
        ValueError: invalid hyper-parameters, a model without a layer K-FAC supports,
            or KL clipping without a learning rate.
    """

    def __init__(
        self,
        model: nn.Module,
        config: KFACConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        group: Any = None,
        costs: KFACCosts | None = None,
    ) -> None:
        self.cfg = config or KFACConfig()
        self.optimizer = optimizer
        module = getattr(model, "module", model)
        if not isinstance(module, nn.Module):
            raise ValueError(f"KFAC expects an nn.Module, got {type(model).__name__}")
        self.stats = KFACStats()
        self.layers = self._register(module)
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self._ranks = dist.get_process_group_ranks(group) if distributed and group else None
        self._groups: dict[tuple[int, ...], Any] = {}
        self.group: Any = None
        if self.world > 1:
            ranks = self._ranks or list(range(self.world))
            self.group = new_group(ranks)
            self._groups[tuple(range(self.world))] = self.group
        if costs is not None and not isinstance(costs, KFACCosts):
            raise ValueError(f"costs must be a KFACCosts, got {type(costs).__name__}")
        self.costs = costs or KFACCosts.measure(
            self.group, method=Method(self.cfg.method), probe_links=self.cfg.probe
        )
        self.distribution: Distribution | None = None
        pipe_cfg = PipelineConfig(
            comm=FactorComm(self.cfg.comm),
            sync=FactorSync(self.cfg.sync),
            packed=self.cfg.packed,
            comm_dtype=self.cfg.comm_dtype,  # type: ignore[arg-type]
            bucket_cap_mb=self.cfg.bucket_cap_mb,
            replan_every=self.cfg.replan_every,
        )
        self.pipeline = FactorPipeline(pipe_cfg, group=self.group, cost=self.costs.link)
        self.assignment: Assignment | None = None
        self.steps = 0
        self._acc: dict[str, _Acc] = {}
        self._second: dict[str, SecondOrder] = {}
        self._pending: dict[str, _Pending] = {}
        self._inflight: list[torch.futures.Future[torch.Tensor]] = []
        self._ready: set[str] = set()  # layers with both decompositions (rank-consistent)
        self._micro = 0
        self._accumulating = False
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._handles: list[Any] = []
        # "auto" intervals: the planner, the intervals in force ((1, 1) for the first
        # WARMUP_STEPS steps, then probe_intervals until the first decision), when
        # this step's forward began
        self._planner: IntervalPlanner | None = None
        if self.cfg.auto_intervals:
            self._planner = IntervalPlanner(
                rho=self.cfg.auto_overhead, max_interval=self.cfg.auto_max_interval,
                drift=self.cfg.auto_drift, window=self.cfg.auto_window,
            )  # fmt: skip
        self.intervals = Intervals(1, 1)
        self._since_decision = 0
        self._probe_end: int | None = None  # the step the first decision waits for
        self._forward_began: float | None = None
        # this step's measured seconds: factor computation in the hooks, inversions (with
        # the waits for their broadcasts)
        self._hook_s = 0.0
        self._inv_s = 0.0
        self.attach()

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
            logger.log(
                logging.WARNING if sel.matrices or sel.shared else logging.INFO,
                "K-FAC leaves these to the optimizer, unpreconditioned: %s",
                ", ".join(parts),
            )
        return sel.layers

    def _make_groups(self, size: int) -> None:
        """Block and receiver groups; created collectively, in the same order on every rank."""
        if self.world <= 1:
            return
        ranks = self._ranks or list(range(self.world))
        tuples: list[tuple[int, ...]] = []
        if 1 < size < self.world:
            tuples += [tuple(range(b, b + size)) for b in range(0, self.world, size)]
        if size < self.world and self.world // size > 1:
            tuples += [tuple(range(j, self.world, size)) for j in range(size)]
        for t in tuples:
            if t not in self._groups:
                self._groups[t] = new_group([ranks[i] for i in t])

    def _group_size(self) -> int:
        d = Distribution(self.cfg.distribution)
        if self.distribution is not None:
            d = self.distribution
        if d is Distribution.COMM_OPT:
            return self.world
        if d is Distribution.MEM_OPT:
            return 1
        size = min(self.cfg.grad_workers or max(1, self.world // 2), self.world)
        if self.world % size:
            raise ValueError(f"grad_workers={size} must divide the world size {self.world}")
        return size

    def _explicit(self, slot: Slot, step: int) -> bool:
        """Whether the inverse method keeps this factor as an explicit inverse.

        AUTO weighs one worker's work between two inversions: the Cholesky form saves an
        explicit inversion (~n^3) and costs slower solves (~n^2 m more, m the partner side)
        at every step until the next inversion. The two forms round differently, so the
        rule reads the model and the settings only, never the placement: placement follows
        measured timings, and a job must train to the same bits whatever it measured
        (alone or co-located, first run or resumed). Per worker is exact where inverters
        use what they invert (mem-opt, local factors); under comm-opt one inversion serves
        several workers, and the rule then leans to the Cholesky form.
        """
        form = InverseForm(self.cfg.inverse_form)
        if form is not InverseForm.AUTO or Method(self.cfg.method) is not Method.INVERSE:
            return form is InverseForm.EXPLICIT
        other = FactorKind.G if slot.kind is FactorKind.A else FactorKind.A
        partner = self.layers[slot.layer].shape(other).dim
        uses = int(self._at("inv_interval", step))
        return uses * partner >= EXPLICIT_PAYOFF * slot.shape.dim

    def attach(self) -> None:
        """Install the factor hooks (done by the constructor; again after `remove`)."""
        if self._handles:
            return
        self._handles = [
            layer.module.register_forward_hook(functools.partial(self._on_forward, layer))
            for layer in self.layers.values()
        ]

    def remove(self) -> None:
        """Detach the hooks (the model is left as it was; `attach` puts them back)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ schedule
    def at(self, name: str, step: int) -> Any:
        """Hyper-parameter `name` (a `KFACConfig` field) at `step`, validated."""
        return self._at(name, step)

    def _at(self, name: str, step: int) -> Any:
        if name == "factor_interval" and self.cfg.factor_interval == AUTO:
            return self.intervals.factor
        if name == "inv_interval" and self.cfg.inv_interval == AUTO:
            return self.intervals.inv
        checks = {
            "damping": {"low": 0.0, "low_open": True},
            "factor_decay": {"low": 0.0, "high": 1.0},
            "kl_clip": {"low": 0.0, "low_open": True},
            "lr": {"low": 0.0},
        }
        return check_value(name, getattr(self.cfg, name), step, **checks.get(name, {}))

    def _is_factor_step(self, step: int) -> bool:
        return step % int(self._at("factor_interval", step)) == 0

    def _is_inv_step(self, step: int) -> bool:
        return step % int(self._at("inv_interval", step)) == 0

    def _lr(self, step: int) -> float:
        if self.cfg.lr is not None:
            return float(self._at("lr", step))
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

    # ------------------------------------------------------------------ hooks
    def reduces(self, layer: KFACLayer) -> bool:
        """Whether `layer` forms its factors by K-FAC-reduce (`KFACConfig.approximation`)."""
        return self.cfg.approximation is Approximation.REDUCE and layer.reducible

    def _capturing(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() and self._is_factor_step(self.steps)

    def _on_forward(
        self, layer: KFACLayer, module: nn.Module, inputs: tuple[Any, ...], output: Any
    ) -> None:
        if self._forward_began is None and module.training and torch.is_grad_enabled():
            self._forward_began = time.perf_counter()
        if not inputs or not isinstance(inputs[0], torch.Tensor) or not self._capturing(module):
            return
        if layer.name not in self.layers:  # left alone on the first step
            return
        x = inputs[0].detach()
        if not self.pipeline.discovered and _shared_by_the_batch(layer, x):
            self._shapes[layer.name] = tuple(x.shape)
            self._leave_alone(layer)
            return
        if not self._accumulating and not self.pipeline.in_step:
            self._begin_pipeline_step()
        t0 = time.perf_counter()
        batch = batch_size(layer, x)
        reduce = self.reduces(layer)
        with span(f"A {layer.name}", FACTOR):
            total, rows = layer.a_sum(x, packed=self.pipeline.layout.packed,
                                      reduce_to=batch if reduce else None)  # fmt: skip
        self._add(layer, FactorKind.A, total, rows)
        self._hook_s += time.perf_counter() - t0
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._on_grad, layer, batch))

    def _leave_alone(self, layer: KFACLayer) -> None:
        """Drop a layer found unfit on the first step (before its factors have a slot)."""
        self.layers.pop(layer.name, None)
        self._acc.pop(factor_key(layer.name, FactorKind.A), None)
        self._acc.pop(factor_key(layer.name, FactorKind.G), None)
        self.stats.batch_shared.append(layer.name)
        logger.warning(
            "K-FAC leaves %s to the optimizer: it is looked up once for the whole batch "
            "(input %s), so its output gradient arrives summed over the samples and its G "
            "factor would depend on how the batch is split among workers",
            layer.name,
            "x".join(map(str, self._first_shape(layer))),
        )

    def _first_shape(self, layer: KFACLayer) -> tuple[int, ...]:
        return self._shapes.get(layer.name, ())

    def _on_grad(self, layer: KFACLayer, batch: int, grad: torch.Tensor) -> None:
        t0 = time.perf_counter()
        with torch.no_grad(), span(f"G {layer.name}", FACTOR):
            total, rows = layer.g_sum(grad.detach(), batch, packed=self.pipeline.layout.packed,
                                      reduce=self.reduces(layer))  # fmt: skip
            self._add(layer, FactorKind.G, total, rows)
        self._hook_s += time.perf_counter() - t0

    def _begin_pipeline_step(self) -> None:
        lazy = FactorSync(self.cfg.sync) is FactorSync.LAZY
        communicate = self._is_inv_step(self.steps) if lazy else True
        decay = float(self._at("factor_decay", self.steps))
        self.pipeline.begin_step(communicate=communicate, decay=decay)

    def _add(self, layer: KFACLayer, kind: FactorKind, total: torch.Tensor, rows: int) -> None:
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
        mean = acc.total.div_(max(acc.rows, 1))
        if kind is FactorKind.G and self._micro:
            mean.mul_(float(self._micro + 1) ** 2)
        if not self.pipeline.in_step:
            self._begin_pipeline_step()
        uses = acc.uses_now
        self.pipeline.put(key, layer=layer.name, kind=kind, shape=layer.shape(kind), wire=mean,
                          uses=uses)  # fmt: skip

    def _finalize_all(self) -> None:
        """Hand over what is left (all factors in the first step), in order of last use."""
        for key in sorted(self._acc, key=lambda k: self._acc[k].last_s):
            name, kind = key.rsplit("/", 1)
            self._finalize(key, self.layers[name], FactorKind(kind))

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients in place; call after backward, before optimizer.step()."""
        t = self.steps
        began, self._forward_began = self._forward_began, None
        entered = time.perf_counter()
        inv_step = self._is_inv_step(t)
        factor_step = self._is_factor_step(t)
        self._inv_s = 0.0
        self._finalize_all()
        lazy = FactorSync(self.cfg.sync) is FactorSync.LAZY
        if (lazy and inv_step and self.world > 1 and self.pipeline.discovered
                and not self.pipeline.in_step):  # fmt: skip
            self.pipeline.begin_step(communicate=True, decay=1.0)
        if self.pipeline.in_step:
            self.pipeline.flush()
            self._ensure_assignment()
            if inv_step and self.cfg.overlap:
                for slots in self.pipeline.completed():
                    self._invert(slots, t)
            else:
                for _ in self.pipeline.completed():
                    pass
                if inv_step:
                    self._invert(self.pipeline.slots, t)
            self.pipeline.end_step()
        elif inv_step:
            self._ensure_assignment()
            self._invert(self.pipeline.slots, t)
        communicated_s = time.perf_counter() - entered - self._inv_s
        self._precondition(t)
        self.steps += 1
        self.stats.steps += 1
        self._micro = 0
        hook_s, self._hook_s = self._hook_s, 0.0
        if self._planner is not None and began is not None and t >= WARMUP_STEPS:
            # the step split into what every step pays and K-FAC's two amortisable parts;
            # lazy sync all-reduces the running factors only to invert them, so that wait
            # belongs to the inversion round (and factor updates between rounds are local)
            round_comm_s = communicated_s if lazy and inv_step else 0.0
            factor_s = hook_s + communicated_s - round_comm_s if factor_step else None
            inv_s = self._inv_s + round_comm_s if inv_step else None
            total_s = time.perf_counter() - began
            self._planner.observe(total_s, factor_s=factor_s, inversion_s=inv_s)
        if self._planner is not None:
            self._plan_intervals(self._planner)

    # ------------------------------------------------------------------ "auto" intervals
    def _plan_intervals(self, planner: IntervalPlanner) -> None:
        """Probe after the warm-up, decide the intervals, and again when the costs drift.

        Each step is timed from its first hooked forward to the end of `step`, and the
        planner prices a factor update and an inversion round by how much longer their
        steps take than plain ones (`plait.kfac.intervals`). The first `WARMUP_STEPS`
        steps run at (1, 1), unmeasured (one-time costs); then `probe_intervals` runs
        `PROBE_ROUNDS` inversion rounds with plain and factor steps between them, and the
        first decision follows (a resumed run probes again: the link may differ). Until a
        kind of step has been seen, K-FAC's own timed parts (factor computations in the
        hooks, the waits for the exchanges, the decompositions) stand in, and before those
        their price from `self.costs`. The medians differ by rank, so they are agreed over
        the group (the largest: the slowest rank sets the pace), at step counts every rank
        reaches together (the end of the probe, then every `auto_window` steps).
        """
        if self.assignment is None or self.steps < WARMUP_STEPS:
            return
        fixed_f, fixed_i = self.cfg.factor_interval, self.cfg.inv_interval
        # the config allows "auto" beside a constant only (never beside a callable)
        fixed = {
            "factor": fixed_f if isinstance(fixed_f, int) else None,
            "inv": fixed_i if isinstance(fixed_i, int) else None,
        }
        if planner.decided is None:
            if self._probe_end is None:
                lazy = FactorSync(self.cfg.sync) is FactorSync.LAZY
                probe = probe_intervals(**fixed, lazy=lazy)
                self._probe_end = self.steps + (
                    PROBE_ROUNDS * probe.inv if probe != self.intervals else 0
                )
                self.intervals = probe
            if self.steps < self._probe_end:
                return
        else:
            self._since_decision += 1
            if self._since_decision < planner.window:
                return
            self._since_decision = 0
        priced = self.step_costs(planner.median() or 0.0)
        costs = self._agree_max(planner.costs(priced))
        if planner.decided is not None and (costs.base_step_s <= 0 or not planner.drifted(costs)):
            return
        if planner.decided is not None:
            logger.info("K-FAC's measured costs drifted: deciding the intervals again")
        self.intervals = planner.decide(costs, **fixed)
        self._since_decision = 0

    def _agree_max(self, costs: StepCosts) -> StepCosts:
        if self.world <= 1:
            return costs
        t = torch.tensor([costs.base_step_s, costs.factor_s, costs.inversion_s],
                         dtype=torch.float64)  # fmt: skip
        ops.all_reduce(t, group=self.group, op=dist.ReduceOp.MAX, name="kfac intervals",
                       async_op=False)  # fmt: skip
        return StepCosts(base_step_s=float(t[0]), factor_s=float(t[1]), inversion_s=float(t[2]))

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
            method = Method(self.cfg.method)
            for s in self.pipeline.slots:
                owner = asg.inv_rank.get(s.key, LOCAL)
                workers = len(asg.inverse_group(s.layer)) if s.layer in asg.layer_rank else 1
                if owner == LOCAL or workers <= 1:
                    continue
                nbytes = 4 * second_order_numel(method, s.shape, packed=self.cfg.packed)
                inv_s += self.costs.link.time(Collective.BROADCAST, nbytes, workers)
        return StepCosts(base_step_s=base_step_s, factor_s=comm_s, inversion_s=inv_s)

    def _ensure_assignment(self) -> None:
        if self.assignment is not None or not self.pipeline.discovered:
            return
        layers = [
            layer
            for name, layer in self.layers.items()
            if self.pipeline.has(factor_key(name, FactorKind.A))
            and self.pipeline.has(factor_key(name, FactorKind.G))
        ]
        distribution = Distribution(self.cfg.distribution)
        size = None if distribution is Distribution.AUTO else self._group_size()
        placement = plan_placement(
            layers,
            world=self.world,
            costs=self.costs,
            method=Method(self.cfg.method),
            packed=self.cfg.packed,
            policy=PlacementPolicy(self.cfg.placement),
            distribution=distribution,
            group_size=size,
            local_inversion=self.cfg.local_inversion,
            inv_interval=int(self._at("inv_interval", self.steps)),
        )
        self.distribution = placement.distribution
        self._make_groups(placement.assignment.group_size)
        self.assignment = placement.assignment

    def _group(self, ranks: tuple[int, ...]) -> Any:
        return self._groups[ranks]

    def _global(self, rank: int) -> int:
        return self._ranks[rank] if self._ranks else rank

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
        damping = float(self._at("damping", step))
        method = Method(self.cfg.method)
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
                with span(f"inverse {s.key}", INVERSE, n=s.shape.dim):
                    so = decompose(self.pipeline.factor_upper(s.key), s.shape, method=method,
                                   damping=damping, packed=self.cfg.packed,
                                   explicit=explicit)  # fmt: skip
                self.stats.inversions += 1
                self._second[s.key] = so
                self._pending.pop(s.key, None)
                if owner == self.rank and len(workers) > 1:
                    wire = so.to_wire(packed=self.cfg.packed)
                    fut = ops.broadcast(wire, src=self._global(owner), group=self._group(workers),
                                        name=f"inverse {s.key}")  # fmt: skip
                    self._inflight.append(fut)
                    self.stats.broadcasts += 1
            else:
                buf = torch.empty(second_order_numel(method, s.shape, packed=self.cfg.packed),
                                  dtype=self.pipeline.running.dtype)  # type: ignore[union-attr]  # fmt: skip
                fut = ops.broadcast(buf, src=self._global(owner), group=self._group(workers),
                                    name=f"inverse {s.key}")  # fmt: skip
                self._pending[s.key] = _Pending(future=fut, buffer=buf, damping=damping,
                                                explicit=explicit)  # fmt: skip

    def _mark_ready(self, layer: str) -> None:
        a, g = factor_key(layer, FactorKind.A), factor_key(layer, FactorKind.G)
        if self.pipeline.is_initialized(a) and self.pipeline.is_initialized(g):
            self._ready.add(layer)

    def _resolve(self, key: str) -> SecondOrder:
        pend = self._pending.pop(key, None)
        if pend is not None:
            t0 = time.perf_counter()
            ops.wait(pend.future)
            self._inv_s += time.perf_counter() - t0  # an inversion done elsewhere
            s = self.pipeline.slot(key)
            self._second[key] = SecondOrder.from_wire(
                pend.buffer, method=Method(self.cfg.method), shape=s.shape,
                damping=pend.damping, packed=self.cfg.packed, explicit=pend.explicit,
            )  # fmt: skip
        return self._second[key]

    def _precondition(self, step: int) -> None:
        asg = self.assignment
        if asg is None:
            return
        # In the model's layer order, on every rank: the broadcasts are issued alike, and the
        # KL clip sums over layers in an order that no timing-based placement can change.
        # Each entry: the layer, its preconditioned gradient (or the buffer a broadcast
        # fills), the raw gradient, and the broadcast to wait for (None: computed here).
        entries: list[tuple[KFACLayer, torch.Tensor, torch.Tensor, Any]] = []
        for name, layer in self.layers.items():
            if name not in asg.layer_rank or name not in self._ready:
                continue
            grad = layer.grad_matrix()
            if grad is None:
                continue
            workers = asg.grad_workers(name)
            p: torch.Tensor | None = None
            if self.rank in workers:
                a = self._resolve(factor_key(name, FactorKind.A))
                g = self._resolve(factor_key(name, FactorKind.G))
                with span(f"precondition {name}", PRECONDITION):
                    p = precondition(grad, a, g).contiguous()
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
            fut = ops.broadcast(buf, src=self._global(src), group=self._group(receivers),
                                name=f"gradient {name}")  # fmt: skip
            entries.append((layer, buf, grad, fut))
        for fut in self._inflight:
            ops.wait(fut)
        self._inflight.clear()
        for *_, fut in entries:
            if fut is not None:
                ops.wait(fut)
        self._write([(layer, p, grad) for layer, p, grad, _ in entries], step)

    def _write(self, pairs: list[tuple[KFACLayer, torch.Tensor, torch.Tensor]], step: int) -> None:
        if not pairs:
            return
        with span("kl clip", PRECONDITION):
            if self.cfg.kl_clip is not None:
                scale = kl_clip_scale(
                    [(p, g) for _, p, g in pairs],
                    lr=self._lr(step),
                    kl_clip=float(self._at("kl_clip", step)),
                ).to(pairs[0][1].dtype)
                for layer, p, _ in pairs:
                    layer.set_grad_matrix(p * scale)
            else:
                for layer, p, _ in pairs:
                    layer.set_grad_matrix(p)

    # ------------------------------------------------------------------ parts of a step
    # What one worker computes in a step, for callers that run it in pieces (the trainer's
    # compute-only reference times these without any communication or state change).
    def is_inversion_step(self, step: int) -> bool:
        """Whether `step` decomposes the factors (every `inv_interval` steps)."""
        return self._is_inv_step(step)

    def inversions_here(self) -> list[Slot]:
        """The factors this worker decomposes itself (its own and the local ones)."""
        asg = self.assignment
        if asg is None:
            return []
        return [
            s
            for s in self.pipeline.slots
            if asg.inv_rank.get(s.key) in (LOCAL, self.rank) and self.pipeline.is_initialized(s.key)
        ]

    def decompose(self, slot: Slot, step: int) -> SecondOrder:
        """Decompose one factor's running average as `step` would; nothing is stored."""
        with span(f"inverse {slot.key}", INVERSE, n=slot.shape.dim):
            return decompose(
                self.pipeline.factor_upper(slot.key),
                slot.shape,
                method=Method(self.cfg.method),
                damping=float(self._at("damping", step)),
                packed=self.cfg.packed,
                explicit=self._explicit(slot, step),
            )

    def held_decompositions(self) -> list[tuple[KFACLayer, SecondOrder, SecondOrder]]:
        """The layers this worker preconditions whose decompositions it already holds."""
        asg = self.assignment
        if asg is None:
            return []
        out = []
        for name in asg.layer_rank:
            if name not in self._ready or self.rank not in asg.grad_workers(name):
                continue
            a = self._second.get(factor_key(name, FactorKind.A))
            g = self._second.get(factor_key(name, FactorKind.G))
            if a is not None and g is not None:
                out.append((self.layers[name], a, g))
        return out

    def write_gradients(
        self, pairs: list[tuple[KFACLayer, torch.Tensor, torch.Tensor]], step: int
    ) -> None:
        """Write preconditioned gradients (layer, preconditioned, raw), KL-clipped together."""
        self._write(pairs, step)

    # ------------------------------------------------------------------ state
    def state_dict(self, *, include_factors: bool = True) -> dict[str, Any]:
        """Step counter and settings; with `include_factors`, running factors and results.

        The state is this worker's own (factors under ``lazy`` sync and the decompositions
        a worker holds differ between workers): checkpoint it per rank.
        """
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "steps": self.steps,
            "config": self.cfg.constants(),
            "intervals": [self.intervals.factor, self.intervals.inv],
            "pipeline": self.pipeline.state_dict(include_factors=include_factors),
        }
        if include_factors:
            for key in list(self._pending):
                self._resolve(key)
            state["second_order"] = {k: so.state() for k, so in self._second.items()}
            state["ready"] = sorted(self._ready)
            if self.assignment is not None:
                state["assignment"] = {
                    "inv_rank": dict(self.assignment.inv_rank),
                    "layer_rank": dict(self.assignment.layer_rank),
                    "group_size": self.assignment.group_size,
                    "world": self.assignment.world,
                    "distribution": str(self.distribution),
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
        if "intervals" in state:  # until "auto" decides again, after the first steps
            self.intervals = Intervals(*map(int, state["intervals"]))
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
        asg = state.get("assignment")
        if asg is not None and asg["world"] == self.world:
            self.assignment = Assignment(
                world=asg["world"], group_size=asg["group_size"], inv_rank=dict(asg["inv_rank"]),
                layer_rank=dict(asg["layer_rank"]),
            )  # fmt: skip
            self.distribution = Distribution(asg["distribution"])
            self._make_groups(self.assignment.group_size)
        else:
            self.assignment = None
            self._ensure_assignment()


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


def batch_size(layer: KFACLayer, x: torch.Tensor) -> int:
    """Samples the layer's mean loss is taken over: the leading dimension of batched input."""
    if isinstance(layer, Conv2dLayer):
        return int(x.shape[0]) if x.dim() == 4 else 1
    if isinstance(layer, EmbeddingLayer):
        return int(x.shape[0]) if x.dim() >= 1 else 1
    return int(x.shape[0]) if x.dim() > 1 else 1
