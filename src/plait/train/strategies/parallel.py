"""The ``plan`` training strategy: `plait train --plan ...` and `plait bench` run plans.

``plan:dp=2,tp=2,zero=3`` applies that plan; ``plan:auto=true[,memory=2GiB]`` asks the
planner, which measures the network and the model in the job itself. The global batch is
the same under every plan (per-worker batch x world size): ranks of one data-parallel
replica read the same shard, split among fewer readers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.comm import Collective
from plait.parallel.plan import Plan, ZeroStage
from plait.train.strategy import LossFn, OptimizerFactory, Strategy, register_strategy
from plait.workloads import Batch

if TYPE_CHECKING:  # the engines load when a plan is applied, not when strategies register
    from plait.parallel.api import ParallelModel


@register_strategy("plan")
class PlanStrategy(Strategy):
    """Train under an n-D parallel plan (see the module docstring).

    Args:
        auto: let the planner choose (needs no other plan keys).
        memory: memory per device for the planner, e.g. ``2GiB`` (default: unlimited).
        **options: plan keys (`Plan` fields): ``dp``, ``tp``, ``pp``, ``zero``, ``sp``,
            ``schedule``, ``microbatches``, ``offload``, ``ac``, ``compression``.
    """

    name = "plan"
    collective_forward = True

    def __init__(self, *, auto: bool = False, memory: str | None = None, **options: Any) -> None:
        if not isinstance(auto, bool):
            raise ValueError(f"plan: auto takes true or false, got {auto!r}")
        from plait.parallel.memory import parse_bytes

        if auto and options:
            raise ValueError(f"plan: auto chooses every key itself, got {sorted(options)}")
        self.plan: Plan | None = None if auto else Plan.from_options(options)
        self.memory_bytes = parse_bytes(memory) if memory is not None else None
        self.choice: Any = None
        self._sample: Batch | None = None
        self._global_batch = 0
        self._optimizer: OptimizerFactory | None = None
        self._optimizer_name: str | None = None
        self._model: ParallelModel | None = None

    @property
    def model(self) -> ParallelModel:
        if self._model is None:
            raise RuntimeError("PlanStrategy.wrap has not run yet")
        return self._model

    def check(self, model: nn.Module, *, world: int) -> None:
        from plait.parallel.resolve import adapter_for

        if self.plan is not None:
            self.plan.validate(world=world, dims=adapter_for(model).dims(model))

    def collectives(self) -> frozenset[Collective]:
        """The plan's: tensor parallelism and ZeRO gather and scatter, pipeline stages send
        and receive; an automatic plan may choose any of them."""
        out = set(super().collectives())
        plan = self.plan
        if plan is None or plan.tp > 1 or plan.zero > ZeroStage.NONE:
            out |= {Collective.ALL_GATHER, Collective.REDUCE_SCATTER}
        if plan is None or plan.pp > 1:
            out.add(Collective.SEND)
        return frozenset(out)

    def bind_data(self, sample: Batch, *, global_batch: int) -> None:
        self._sample = sample
        self._global_batch = global_batch

    def bind_optimizer(self, factory: OptimizerFactory, *, name: str) -> None:
        self._optimizer = factory
        self._optimizer_name = name

    def wrap(self, model: nn.Module) -> nn.Module:
        plan = self.plan
        if plan is None:
            from plait.parallel.planner import auto_plan, optimizer_states_of

            if self._sample is None:
                raise ValueError("plan:auto needs a sample batch (Strategy.bind_data)")
            name = self._optimizer_name
            self.choice = auto_plan(
                model,
                sample=self._sample,
                global_batch=self._global_batch or None,
                memory_bytes=self.memory_bytes,
                optimizer=self._optimizer,
                optimizer_states=2 if name is None else optimizer_states_of(name),
            )
            plan = self.choice.plan
        from plait.parallel.api import ParallelModel

        self._model = ParallelModel.build(model, plan)
        self.plan = self._model.plan
        return self._model

    def build_optimizer(self, model: nn.Module, factory: OptimizerFactory) -> torch.optim.Optimizer:
        return self.model.build_optimizer(factory(self.model.parameters()))

    def data_parallel_rank(self) -> int:
        return self.model.data_parallel_rank

    def data_parallel_size(self) -> int:
        return self.model.data_parallel_size

    def forward_backward(self, model: nn.Module, micro: list[Batch], loss_fn: LossFn) -> float:
        self.model.loss_fn = loss_fn
        total = 0.0
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                total += float(self.model.step(x, y, scale=1.0 / len(micro))) / len(micro)
        return total

    def eval_forward(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor | None:
        return self.model.evaluate(x, y)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return self.model.no_sync()

    @contextlib.contextmanager
    def compute_only(self, model: nn.Module) -> Iterator[None]:
        """Without data-axis gradient communication where that leaves no trace.

        FSDP (ZeRO-2/3) would keep the unsynchronised gradients for the next step, so its
        plans run the full step; tensor and pipeline communication always runs.
        """
        if self.model.plan.zero >= ZeroStage.GRADIENTS:
            yield
        else:
            with self.model.no_sync():
                yield

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.model.state_module()

    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        from plait.parallel.checkpoint import state_dict

        return state_dict(self.model, optimizer)

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        from plait.parallel.checkpoint import load_state_dict

        load_state_dict(self.model, optimizer, state)

    def state_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.describe() if self.plan else "auto"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: a checkpoint of another plan resumes under this one."""

    def close(self) -> None:
        if self._model is None:
            return
        for part in self._model.parts:
            comp = getattr(part, "plait_compressor", None)
            if comp is not None:
                comp.close()

    def describe(self) -> str:
        return f"plan:{self.plan.describe()}" if self.plan else "plan:auto"
