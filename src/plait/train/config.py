"""The training run's configuration: `TrainConfig` and the `StrategyChoice` it resolves.

Plain data, importable without torch: the command line builds its flags from
`TrainConfig`'s fields (`plait.flags`: each field's `option` holds its help), and
``plait --help`` must not wait for torch.
Checking a config builds its workload and strategy, which import torch then.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from plait.flags import option
from plait.specs import OptionValue, parse_spec

if TYPE_CHECKING:
    from plait.train.strategy import Strategy

#: Optimizer names: ``sgd`` (with `TrainConfig.momentum`), ``sgd-plain`` (no momentum: the
#: optimizer for K-FAC's eigenbasis-Adam mode, whose moments are its own), ``adam``,
#: ``adamw``, ``muon`` (`plait.train.optim.MuonAdamW`), ``muon-fp32`` (the same with its
#: Newton-Schulz iteration in float32, for CPUs without bf16 units) and ``heavyball-soap``
#: (heavyball's SOAP, the `bench` extra; `plait.train.optim.heavyball_soap`).
OPTIMIZERS = ("sgd", "sgd-plain", "adam", "adamw", "muon", "muon-fp32", "heavyball-soap")


def _option_text(value: OptionValue) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class StrategyChoice:
    """A strategy by registered name with typed options: what a spec string describes.

    `TrainConfig` resolves its flags into one of these once, validated, and the trainer
    builds the strategy from it; the spec text is only its rendering (`spec`).

    Attributes:
        name: a registered strategy (``ssgd``, ``acpsgd``, ``spd-kfac``, ``plan``, ...).
        options: the strategy's keyword options (``{"rank": 4}``).
    """

    name: str
    options: Mapping[str, OptionValue] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> StrategyChoice:
        """The choice a spec string names (``acpsgd:rank=4``), options typed."""
        name, options = parse_spec(spec)
        return cls(name, options)

    def spec(self) -> str:
        """The spec string of this choice (``acpsgd:rank=4``), as the command line takes."""
        if not self.options:
            return self.name
        opts = ",".join(f"{k}={_option_text(v)}" for k, v in self.options.items())
        return f"{self.name}:{opts}"

    def build(self) -> Strategy:
        """The strategy, built (which checks the name and every option, and starts nothing).

        Raises:
            ValueError: an unknown name or option, or a bad option value.
        """
        from plait.train.strategy import make_strategy

        return make_strategy(self.name, **dict(self.options))

    def validate(self) -> None:
        """Check the name and every option without keeping the strategy."""
        self.build().close()


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a training run needs; its flags are generated from it (`plait.flags`).

    Attributes:
        workload: a name from `plait.workloads.WORKLOADS`.
        strategy: strategy spec, ``name[:k=v,...]``, or a `StrategyChoice` (stored as its
            spec, so the config stays plain data for JSON and checkpoints).
        data: ``real`` (bundled data set with a test split) or ``synthetic``.
        epochs: passes over the training data (default: the workload's).
        steps: optimizer steps to run; overrides `epochs` when given.
        batch_size: per-worker batch size (default: the workload's).
        accumulate: micro-batches per optimizer step (gradient accumulation).
        lr, optimizer, momentum, weight_decay: the optimizer.
        seed: model initialisation, data order and dropout.
        checkpoint: directory for checkpoints (None: no checkpoints).
        checkpoint_every: steps between checkpoints (0: only at epoch ends).
        trace: write a merged Chrome trace of all ranks here.
        out: write the run's metrics (JSON) here.
        progress: draw a progress bar on rank 0.
        synthetic_samples: size of the synthetic data set.
        crossover: share the device's compute token with co-located jobs of this group
            (`plait.crossover`); None runs alone.
        eval_every: also evaluate every this many steps (0: at epoch ends only); the
            results form the run's learning curve (``curve`` in the summary).
        plan: an n-D parallel plan (``dp=2,tp=2,zero=3``, see `plait.parallel.Plan`) or
            ``auto``; `strategy` then names the data axis's compressor.
        memory: memory per device the automatic planner must fit in (``2GiB``).
        tensorboard: write rank 0's scalars (loss, held-out metrics, throughput, bytes
            per step) as TensorBoard events into this directory.

    The strategy the run trains with, `plan` and `memory` included, is resolved and
    validated once, at construction, into `strategy_choice`.
    """

    workload: str = option(
        "mlp",
        "a registered workload (mlp, resnet18, vgg, gpt, digits-mlp, ...) or a factory, "
        "pkg.module:factory or path/to/file.py:factory",
    )
    strategy: str | StrategyChoice = option("ssgd", "strategy spec, e.g. ssgd or acpsgd:rank=4")
    data: Literal["real", "synthetic"] = option(
        "real", "the workload's bundled real data, or synthetic data of its shapes"
    )
    epochs: int | None = option(
        None, "passes over the data (default: the workload's)", exclusive="length"
    )
    steps: int | None = option(None, "optimizer steps (instead of epochs)", exclusive="length")
    batch_size: int | None = option(None, "per-worker batch size (default: the workload's)")
    accumulate: int = option(1, "micro-batches per optimizer step")
    lr: float | None = option(None, "learning rate (default: the workload's)")
    optimizer: str | None = option(
        None,
        "optimizer (default: the workload's); muon: torch.optim.Muon for the weight "
        "matrices, AdamW for the rest; muon-fp32: the same in float32 (CPUs without bf16)",
        choices=OPTIMIZERS,
    )
    momentum: float = option(0.9, "SGD momentum")
    weight_decay: float = option(0.0, "weight decay")
    seed: int = option(0, "seed of the initial weights, data order and compressors")
    checkpoint: str | None = option(None, "checkpoint directory (resumes from it)")
    checkpoint_every: int = option(0, "steps between checkpoints")
    trace: str | None = option(None, "write a merged Chrome trace here")
    out: str | None = option(None, "write the run's metrics (JSON) here")
    progress: bool = option(True, "no progress bar")
    synthetic_samples: int = 1024
    crossover: str | None = option(
        None,
        "share each device's compute token with co-located jobs of GROUP",
        metavar="GROUP",
    )
    eval_every: int = option(0, "also evaluate every K steps (a learning curve in --out)")
    plan: str | None = option(
        None,
        "n-D parallel plan, e.g. dp=2,tp=2,zero=3 or pp=4,schedule=interleaved, or auto "
        "(--strategy then names the data axis's compressor)",
    )
    memory: str | None = option(
        None, "memory per device for --plan auto: 2GiB = 2*2^30 bytes, 2GB = 2*10^9"
    )
    tensorboard: str | None = option(
        None,
        "also write rank 0's scalars (loss, held-out metrics, throughput, bytes per step) "
        "as TensorBoard events here",
        metavar="DIR",
    )

    def __post_init__(self) -> None:
        from plait.workloads import get_workload

        get_workload(self.workload)
        if isinstance(self.strategy, StrategyChoice):
            self.strategy = self.strategy.spec()
        #: the strategy to train with, typed; unknown names and bad options fail here
        self.strategy_choice = self._resolve_strategy()
        self.strategy_choice.validate()
        if self.data not in ("real", "synthetic"):
            raise ValueError(f"data must be 'real' or 'synthetic', got {self.data!r}")
        for key in ("epochs", "steps", "batch_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be >= 1, got {self.accumulate}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose from {OPTIMIZERS}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")

    def _resolve_strategy(self) -> StrategyChoice:
        """`strategy` alone, or the plan strategy with `strategy` as its data-axis compressor."""
        assert isinstance(self.strategy, str)  # __post_init__ stores a choice as its spec
        compressor = StrategyChoice.parse(self.strategy)
        if self.plan is None:
            if self.memory is not None:
                raise ValueError("memory applies to the automatic planner (--plan auto)")
            return compressor
        if compressor.options:
            raise ValueError(
                f"with --plan, --strategy names a compressor only, got {self.strategy!r}"
            )
        if self.plan.strip() == "auto":
            if compressor.name != "ssgd":
                raise ValueError("--plan auto chooses the data axis itself; drop --strategy")
            options: dict[str, OptionValue] = {"auto": True}
            if self.memory:
                options["memory"] = self.memory
            return StrategyChoice("plan", options)
        if self.memory is not None:
            raise ValueError("memory applies to the automatic planner (--plan auto)")
        _, degrees = parse_spec(f"plan:{self.plan}")
        if compressor.name != "ssgd":
            degrees["compression"] = compressor.name
        return StrategyChoice("plan", degrees)

    def strategy_spec(self) -> str:
        """The spec text of `strategy_choice` (for messages and records)."""
        return self.strategy_choice.spec()
