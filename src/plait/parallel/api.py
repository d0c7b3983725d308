"""`ParallelModel`: a sequential model and its optimizer, spread over the world by a `Plan`.

The order of application follows the engines' contracts: the adapter's conversions, then
the pipeline split, tensor/sequence parallelism of the blocks (DTensor), activation
checkpointing, and last the data axis: FSDP2 for ZeRO-2/3; for ZeRO-0/1, DDP with plait's
compressors when there is neither tensor nor pipeline parallelism, otherwise plait's
bucketed gradient averaging after backward (DDP cannot hold DTensor parameters, and its
reducer breaks when a pipeline schedule runs several forwards before a backward). The
optimizer is rebuilt over the new parameters with the same class, groups and
hyper-parameters (ZeroRedundancyOptimizer around it for ZeRO-1).

The returned `ParallelModel` runs a training step with `step(x, y)`, which also drives the
pipeline schedule and returns the loss averaged over the whole (global) batch, and says
which shard of the data this rank reads (`data_parallel_rank/size`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.nn.parallel import DistributedDataParallel

from plait.comm import ops
from plait.parallel.adapters import ModelAdapter, Unit
from plait.parallel.gradsync import GradientSync
from plait.parallel.mesh import ParallelMesh
from plait.parallel.pipeline import (
    StageModule,
    build_schedule,
    check_untied,
    split_units,
    stage_indices,
)
from plait.parallel.plan import Plan, ZeroStage
from plait.parallel.resolve import adapter_for
from plait.parallel.tensor import apply_tensor_parallel, checkpoint_activations
from plait.workloads import logits_of

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position (classifiers and language models alike).

    `output` may be what a model nobody here wrote returns: a `ModelOutput` or dict whose
    own ``loss`` is used when the model computed one (it was given labels), else its
    ``logits`` (`plait.workloads.logits_of`).
    """
    own = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor) and not isinstance(output, torch.Tensor):
        return own
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class ScaledLoss:
    """The loss a pipeline schedule calls: replaceable, and scaled for accumulation."""

    def __init__(self, fn: LossFn) -> None:
        self.fn = fn
        self.scale = 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.fn(output, target)
        return loss * self.scale if self.scale != 1.0 else loss


class ParallelModel(nn.Module):
    """The local part of a model under a plan (see the module docstring).

    Build it with `ParallelModel.build` or `plait.parallelize`; `parts` holds this rank's
    modules (the whole model, or its pipeline stages), each wrapped for the data axis.
    """

    def __init__(
        self,
        *,
        plan: Plan,
        mesh: ParallelMesh | None,
        adapter: ModelAdapter,
        parts: list[nn.Module],
        loss_fn: ScaledLoss,
        schedule: Any = None,
        has_last_stage: bool = True,
        has_first_stage: bool = True,
        grad_sync: GradientSync | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        self.adapter = adapter
        self.parts = nn.ModuleList(parts)
        self._loss = loss_fn
        self.schedule = schedule
        self.has_last_stage = has_last_stage
        self.has_first_stage = has_first_stage
        self.grad_sync = grad_sync
        self._eval_batch = 0

    # -------------------------------------------------------------- building
    @classmethod
    def build(
        cls,
        model: nn.Module,
        plan: Plan,
        *,
        loss_fn: LossFn = cross_entropy,
        device: torch.device | None = None,
    ) -> ParallelModel:
        """Apply `plan` to `model` (in place; collective: every rank calls it).

        Raises:
            ValueError: the plan does not fit the world size or the model (checked before
                any process group is created).
        """
        adapter = adapter_for(model)
        adapter.prepare(model)
        world = dist.get_world_size() if dist.is_initialized() else 1
        plan = plan.validate(world=world, dims=adapter.dims(model))
        dev = device or next(model.parameters()).device
        if not dist.is_initialized():
            if not plan.single_process:
                raise ValueError(f"plan {plan.describe()} needs an initialised process group")
            if plan.ac:
                checkpoint_activations([model.get_submodule(b) for b in adapter.blocks(model)])
            return cls(
                plan=plan, mesh=None, adapter=adapter, parts=[model], loss_fn=ScaledLoss(loss_fn)
            )
        blocks = adapter.blocks(model)
        per_stage: list[list[Unit]] = []
        if plan.pp > 1:  # checked before the mesh: a model that does not split fails here
            per_stage = split_units(adapter.pipeline_units(model), blocks, plan.n_stages())
            check_untied(per_stage)
        mesh = ParallelMesh.build(plan, device=dev)
        stage_ids = stage_indices(plan.schedule, plan.pp, mesh.rank("pp"))
        if plan.pp > 1:
            parts: list[nn.Module] = [StageModule(per_stage[s]) for s in stage_ids]
        else:
            parts = [model]
        part_blocks = [[p.get_submodule(b) for b in blocks if _has_submodule(p, b)] for p in parts]
        if plan.tp > 1:
            for pb in part_blocks:
                apply_tensor_parallel(
                    pb,
                    adapter=adapter,
                    mesh=mesh.sub("tp"),
                    sequence_parallel=plan.sp,
                    sequence_dim=adapter.sequence_dim(model),
                )
        if plan.ac:
            for pb in part_blocks:
                checkpoint_activations(pb)
        parts, grad_sync = _wrap_data_axis(parts, part_blocks, plan=plan, mesh=mesh)
        loss = ScaledLoss(loss_fn)
        schedule = None
        first = last = True
        if plan.pp > 1:
            n = plan.n_stages()
            stages: list[_PipelineStageBase] = [
                PipelineStage(p, s, n, dev, group=mesh.group("pp"))
                for p, s in zip(parts, stage_ids, strict=True)
            ]
            schedule = build_schedule(
                plan.schedule, stages, n_microbatches=plan.n_microbatches(), loss_fn=loss
            )
            first, last = 0 in stage_ids, n - 1 in stage_ids
        return cls(
            plan=plan,
            mesh=mesh,
            adapter=adapter,
            parts=parts,
            loss_fn=loss,
            schedule=schedule,
            has_first_stage=first,
            has_last_stage=last,
            grad_sync=grad_sync,
        )

    def build_optimizer(self, template: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to train with: `template`'s class, groups and hyper-parameters.

        `template` may be built over this model's parameters or over the original model's
        (matched by name); its state must be empty. ZeRO-1 wraps it in
        ZeroRedundancyOptimizer over the data axis.

        Raises:
            ValueError: the template already has state, or names no parameter of the model.
        """
        if template.state:
            raise ValueError("parallelize needs a fresh optimizer (its state is not empty)")
        local = list(self.named_local_parameters())
        if len(template.param_groups) == 1:
            groups = [{**_hyper(template.param_groups[0]), "params": [p for _, p in local]}]
        else:
            groups = self._match_groups(template, local)
        if not any(g["params"] for g in groups):
            raise ValueError("the optimizer holds none of the model's parameters")
        groups = [g for g in groups if g["params"]]
        cls = type(template)
        if self.plan.zero is ZeroStage.OPTIMIZER and self.mesh is not None:
            return ZeroRedundancyOptimizer(
                groups,
                optimizer_class=cls,
                process_group=self.mesh.group("dp"),
                **_constructor_defaults(template),
            )
        same = len(groups) == len(template.param_groups) and all(
            [id(p) for p in g["params"]] == [id(p) for p in t["params"]]
            for g, t in zip(groups, template.param_groups, strict=True)
        )
        return template if same else cls(groups, **_constructor_defaults(template))

    @staticmethod
    def _match_groups(
        template: torch.optim.Optimizer, local: list[tuple[str, nn.Parameter]]
    ) -> list[dict[str, Any]]:
        """Param groups of `template` mapped onto `local` by identity or original name."""
        local_names = {id(p): n for n, p in local}
        original_names: dict[int, str] = getattr(template, "_plait_names", {})
        where: dict[str, int] = {}
        for i, group in enumerate(template.param_groups):
            for p in group["params"]:
                name = local_names.get(id(p)) or original_names.get(id(p))
                if name is not None:
                    where[name] = i
        groups: list[dict[str, Any]] = [{**_hyper(g), "params": []} for g in template.param_groups]
        unmatched = [n for n, _ in local if n not in where]
        for name, p in local:
            if name in where:
                groups[where[name]]["params"].append(p)
        if unmatched:
            raise ValueError(
                f"parameters {unmatched[:4]} belong to no optimizer group; with several groups "
                "build the optimizer over the model after its adapter's conversions"
            )
        return groups

    @property
    def loss_fn(self) -> LossFn:
        return self._loss.fn

    @loss_fn.setter
    def loss_fn(self, fn: LossFn) -> None:
        self._loss.fn = fn

    # ------------------------------------------------------------- queries
    def local_modules(self) -> list[nn.Module]:
        """This rank's modules without their data-parallel wrappers (state-dict keys)."""
        return [p.module if isinstance(p, DistributedDataParallel) else p for p in self.parts]

    def state_module(self) -> nn.Module:
        """One module holding this rank's parameters under their original names."""
        parts = self.local_modules()
        if len(parts) == 1:
            return parts[0]
        stages = [p for p in parts if isinstance(p, StageModule)]
        assert len(stages) == len(parts), "several local parts are pipeline stages"
        return StageModule([u for stage in stages for u in stage.units])

    def named_local_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under their names in the original model."""
        seen: set[int] = set()
        for module in self.local_modules():
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    @property
    def data_parallel_rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.dp_rank

    @property
    def data_parallel_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.dp_size

    # ------------------------------------------------------------- running
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.schedule is not None:
            raise ValueError("a pipelined model runs through step() and evaluate()")
        return self.parts[0](*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without data-axis communication."""
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                if isinstance(p, DistributedDataParallel):
                    stack.enter_context(p.no_sync())
                elif isinstance(p, FSDPModule):
                    p.set_requires_gradient_sync(False)
                    stack.callback(p.set_requires_gradient_sync, True)
            if self.grad_sync is not None:
                self.grad_sync.enabled = False
                stack.callback(setattr, self.grad_sync, "enabled", True)
            yield

    def step(self, x: torch.Tensor, y: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of this rank's batch; the loss averaged over the global batch.

        Gradients accumulate (call `optimizer.zero_grad()` yourself). `scale` multiplies the
        loss before backward (1 / accumulation steps). Every rank returns the same value.
        """
        self._loss.scale = scale
        with ops.collective_errors("step"):  # DTensor's and pipelining's collectives too
            if self.schedule is not None:
                losses: list[torch.Tensor] = []
                args = (x,) if self.has_first_stage else ()
                self.schedule.step(*args, target=y, losses=losses)
                local = torch.stack(losses).mean().detach() / scale if self.has_last_stage else None
            else:
                loss = self.loss_fn(self.parts[0](x), y)
                (loss * scale).backward()
                local = loss.detach()
            if self.grad_sync is not None:
                self.grad_sync.sync()
            return self._global_mean(local)

    def _global_mean(self, local: torch.Tensor | None) -> torch.Tensor:
        """Mean over data-parallel replicas of the loss held by last pipeline stages."""
        if self.mesh is None or dist.get_world_size() == 1:
            assert local is not None
            return local.float()
        buf = torch.zeros(1, dtype=torch.float64)
        if local is not None:
            buf[0] = float(local)
        ops.all_reduce(buf, name="loss", async_op=False)
        return (buf[0] / (self.mesh.dp_size * self.mesh.size("tp"))).float()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Forward only; the output on ranks holding the last stage, None elsewhere.

        A pipeline runs its schedule forward-only. Its stages keep the shapes of their
        first evaluation, so every batch is padded (repeating its last sample) to the
        largest batch seen, a multiple of the micro-batches, and the padding is cut off.
        """
        if self.schedule is None:
            return self.parts[0](x)  # type: ignore[no-any-return]
        n = x.shape[0]
        m = self.plan.n_microbatches()
        self._eval_batch = max(self._eval_batch, -(-n // m) * m)
        pad = self._eval_batch - n
        if pad:
            x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
            y = torch.cat([y, y[-1:].expand(pad, *y.shape[1:])])
        args = (x,) if self.has_first_stage else ()
        out = self.schedule.eval(*args, target=y, losses=[])
        return out[:n] if self.has_last_stage else None


def _wrap_data_axis(
    parts: list[nn.Module], part_blocks: list[list[nn.Module]], *, plan: Plan, mesh: ParallelMesh
) -> tuple[list[nn.Module], GradientSync | None]:
    """FSDP2 (ZeRO-2/3), DDP with the plan's compressor, or plait's gradient averaging."""
    if plan.zero >= ZeroStage.GRADIENTS:
        offload: OffloadPolicy = (
            CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if plan.offload
            else OffloadPolicy()
        )
        kw: dict[str, Any] = {
            "mesh": mesh.sub("dp"),
            "reshard_after_forward": plan.zero is ZeroStage.PARAMETERS,
            "offload_policy": offload,
        }
        for part, blocks in zip(parts, part_blocks, strict=True):
            for block in blocks:  # one all-gather / reduce-scatter group per block
                fully_shard(block, **kw)
            fully_shard(part, **kw)
        return parts, None
    if mesh.dp_size == 1:
        return parts, None
    if plan.tp == 1 and plan.pp == 1:
        from plait.dp.api import data_parallel

        return [data_parallel(p, plan.compression, group=mesh.group("dp")) for p in parts], None
    return parts, GradientSync((q for p in parts for q in p.parameters()), group=mesh.group("dp"))


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (some are derived, not args)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
