"""The training loop behind `plait train`: any workload, any registered strategy.

Run it under torchrun (`plait train` launches it on an emulated cluster): every rank trains
its shard of the data, rank 0 draws the progress bar and prints per-epoch loss, test
accuracy and throughput. With a checkpoint directory it saves every `checkpoint_every`
steps and at every epoch end, and a restarted job (torchrun `--max-restarts`) resumes from
the newest complete checkpoint, reproducing the uninterrupted run. Checkpoints are written
atomically with a manifest, a corrupt or unfinished newest one is skipped with a warning,
and they load as plain data only (`plait.train.checkpoint`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Subset

from plait import distributed as pdist
from plait.comm import stats as comm_stats
from plait.comm.ops import collective_errors
from plait.crossover.scheduler import Crossover, attach
from plait.log import summary_writer
from plait.specs import OptionValue, parse_spec
from plait.trace import COMPUTE, OPTIM, span, tracer
from plait.train.checkpoint import Checkpointer, has_sharded, load_sharded
from plait.train.optim import MuonAdamW, heavyball_soap
from plait.train.strategy import Strategy, make_strategy
from plait.workloads import DataSplit, Workload, get_workload

#: Optimizer names: ``sgd`` (with `TrainConfig.momentum`), ``sgd-plain`` (no momentum: the
#: optimizer for K-FAC's eigenbasis-Adam mode, whose moments are its own), ``adam``,
#: ``adamw``, ``muon`` (`plait.train.optim.MuonAdamW`) and ``heavyball-soap`` (heavyball's
#: SOAP, the `bench` extra; `plait.train.optim.heavyball_soap`).
OPTIMIZERS = ("sgd", "sgd-plain", "adam", "adamw", "muon", "heavyball-soap")

logger = logging.getLogger(__name__)


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
        return make_strategy(self.name, **dict(self.options))

    def validate(self) -> None:
        """Check the name and every option without keeping the strategy."""
        self.build().close()


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a training run needs; the CLI flags map one to one.

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

    workload: str = "mlp"
    strategy: str | StrategyChoice = "ssgd"
    data: str = "real"
    epochs: int | None = None
    steps: int | None = None
    batch_size: int | None = None
    accumulate: int = 1
    lr: float | None = None
    optimizer: str | None = None
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint: str | None = None
    checkpoint_every: int = 0
    trace: str | None = None
    out: str | None = None
    progress: bool = True
    synthetic_samples: int = 1024
    crossover: str | None = None
    eval_every: int = 0
    plan: str | None = None
    memory: str | None = None
    tensorboard: str | None = None

    def __post_init__(self) -> None:
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


@dataclass
class TrainState:
    """Loop position, saved in checkpoints."""

    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    curve: list[dict[str, Any]] = field(default_factory=list)


def build_optimizer(
    name: str, params: Any, *, lr: float, momentum: float = 0.9, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "sgd-plain":
        return torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "muon":  # Muon for the matrices, AdamW for the rest (plait.train.optim)
        return MuonAdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "heavyball-soap":
        return heavyball_soap(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


class Trainer:
    """One training run on the current process group; see the module docstring."""

    def __init__(self, config: TrainConfig, *, strategy: Strategy | None = None) -> None:
        self.cfg = config
        self.wl: Workload = get_workload(config.workload)
        self.world = pdist.world_size()
        self.rank = pdist.rank()
        self.device = pdist.device()
        seed_everything(config.seed)
        self.data: DataSplit = (
            self.wl.real()
            if config.data == "real"
            else self.wl.bench_data(config.synthetic_samples)
        )
        model = self.wl.model(self.data.info).to(self.device)
        self.strategy = strategy or config.strategy_choice.build()
        self.batch_size = config.batch_size or self.wl.train_batch
        sample = next(iter(DataLoader(self.data.train, batch_size=self.batch_size)))
        self.strategy.bind_data(
            (sample[0].to(self.device), sample[1].to(self.device)),
            global_batch=self.batch_size * self.world,
        )
        self.model = self.strategy.wrap(model)
        # the global batch is batch_size x world whatever the strategy; ranks that share a
        # data shard (tensor/pipeline parallel) split it among fewer readers
        self.dp_rank = self.strategy.data_parallel_rank()
        self.dp_size = self.strategy.data_parallel_size()
        self.loader_batch = self.batch_size * self.world // self.dp_size
        self.optimizer = self.strategy.build_optimizer(
            self.model,
            lambda params: build_optimizer(
                config.optimizer or self.wl.optimizer,
                params,
                lr=config.lr or self.wl.lr,
                momentum=config.momentum,
                weight_decay=config.weight_decay,
            ),
        )
        self.strategy.attach_optimizer(self.optimizer)
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            self.data.train,
            num_replicas=self.dp_size,
            rank=self.dp_rank,
            shuffle=True,
            seed=config.seed,
            drop_last=True,
        )
        n_train = len(self.data.train)  # type: ignore[arg-type]
        per_epoch = len(self.sampler) // (self.loader_batch * config.accumulate)
        if per_epoch < 1:
            raise ValueError(
                f"{n_train} training samples over {self.dp_size} data shards are fewer "
                f"than one step of batch {self.loader_batch} x accumulate {config.accumulate}"
            )
        self.steps_per_epoch = per_epoch
        if config.steps is not None:
            self.total_steps = config.steps
        else:
            self.total_steps = per_epoch * (config.epochs or self.wl.epochs)
        self.state = TrainState()
        self.ckpt = Checkpointer(config.checkpoint) if config.checkpoint else None
        self.resumed_from: int | None = None
        self.crossover: Crossover | None = None
        if config.crossover:
            self.crossover = attach(self.model, group=config.crossover)
        #: wall-clock end of every step of this session (throughput windows of co-located jobs)
        self.step_end_unix: list[float] = []
        self.step_losses: list[float] = []
        if config.trace:
            tracer.enable()
        #: rank 0's TensorBoard writer (``tensorboard``), None elsewhere
        self.tensorboard = (
            summary_writer(config.tensorboard) if config.tensorboard and pdist.is_main() else None
        )

    # ------------------------------------------------------------ checkpoints
    def save(self) -> None:
        if self.ckpt is None:
            return
        sharded = self.strategy.checkpoint_state(self.model, self.optimizer)
        shared: dict[str, Any] = {"state": asdict(self.state), "config": asdict(self.cfg)}
        if sharded is None:
            shared["model"] = self.strategy.unwrap(self.model).state_dict()
            shared["optimizer"] = self.optimizer.state_dict()
        local = {"strategy": self.strategy.state_dict(), "rng": _rng_state()}
        self.ckpt.save(self.state.step, shared=shared, local=local, sharded=sharded)

    def maybe_resume(self) -> bool:
        if self.ckpt is None:
            return False
        newest = self.ckpt.load_newest()  # older ones when the newest is refused
        if newest is None:
            return False
        path, shared, local = newest
        if has_sharded(path):
            sharded = self.strategy.checkpoint_state(self.model, self.optimizer)
            if sharded is None:
                raise ValueError(f"{path} holds sharded state; resume it with a plan strategy")
            load_sharded(path, sharded)
            self.strategy.load_checkpoint_state(self.model, self.optimizer, sharded)
        else:
            self.strategy.unwrap(self.model).load_state_dict(shared["model"])
            self.optimizer.load_state_dict(shared["optimizer"])
        self.state = TrainState(**shared["state"])
        if local is not None:
            self.strategy.load_state_dict(local["strategy"])
            _set_rng_state(local["rng"])
        elif pdist.is_main():
            logger.warning("checkpoint from another world size: strategy state starts fresh")
        self.resumed_from = self.state.step
        if pdist.is_main():
            logger.info(
                "plait: resumed from %s (step %d, epoch %d)",
                path,
                self.state.step,
                self.state.epoch,
            )
        return True

    # ------------------------------------------------------------------ steps
    def _batches(self, epoch: int, skip: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.sampler.set_epoch(epoch)
        indices = list(self.sampler)[skip * self.loader_batch * self.cfg.accumulate :]
        loader = DataLoader(
            Subset(self.data.train, indices),
            batch_size=self.loader_batch,
            shuffle=False,
            drop_last=True,
        )
        for x, y in loader:
            yield x.to(self.device), y.to(self.device)

    def train_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward/backward over the micro-batches, then one optimizer step; returns the loss."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        driven = self.strategy.forward_backward(self.model, micro, self.wl.loss)
        total = 0.0 if driven is None else driven
        for i, (x, y) in enumerate(micro if driven is None else []):
            last = i == len(micro) - 1
            ctx = self.strategy.no_sync(self.model) if not last else contextlib.nullcontext()
            with ctx:
                with span("forward", COMPUTE):
                    loss = self.wl.loss(self.model(x), y) / len(micro)
                with span("backward", COMPUTE):
                    loss.backward()
            total += float(loss.detach())
        self.strategy.observe_loss(total)
        with span("optimizer", OPTIM):
            self.strategy.before_optimizer_step(self.model)
            self.optimizer.step()
        return total

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Test loss and accuracy over the whole test split, sharded across ranks."""
        if self.data.test is None:
            return {}
        self.model.eval()
        n = len(self.data.test)  # type: ignore[arg-type]
        if self.strategy.collective_forward:  # every rank runs the same number of batches
            n -= n % self.dp_size
        shard = Subset(self.data.test, range(self.dp_rank, n, self.dp_size))
        sums = torch.zeros(3, dtype=torch.float64)
        with self.strategy.eval_context(self.model):
            for xb, yb in DataLoader(shard, batch_size=256):
                x, y = xb.to(self.device), yb.to(self.device)
                out = self.strategy.eval_forward(self.model, x, y)
                if out is None:  # e.g. a pipeline stage before the last
                    continue
                correct, count = self.wl.correct(out, y)
                sums += torch.tensor(
                    [float(self.wl.loss(out, y)) * count, correct, count], dtype=torch.float64
                )
        if self.world > 1:
            dist.all_reduce(sums)
        loss_sum, correct, count = sums.tolist()
        return {"test_loss": loss_sum / count, "test_accuracy": correct / count}

    def run(self) -> TrainState:
        cfg = self.cfg
        self.maybe_resume()
        bar = _progress(self.total_steps, self.state.step, enabled=cfg.progress and pdist.is_main())
        step_times: list[float] = []
        losses: list[float] = []
        while self.state.step < self.total_steps:
            epoch = self.state.epoch
            batches = self._batches(epoch, self.state.batch_in_epoch)
            epoch_start = time.perf_counter()
            while self.state.step < self.total_steps:
                micro = list(itertools.islice(batches, cfg.accumulate))
                if len(micro) < cfg.accumulate:
                    break
                t0 = time.perf_counter()
                with comm_stats.window() as collectives:
                    loss = self.train_step(micro)
                step_times.append(time.perf_counter() - t0)
                self._log_step(loss, step_times[-1], sum(c.wire_bytes for c in collectives))
                self.step_end_unix.append(time.time())
                self.step_losses.append(loss)
                losses.append(loss)
                self.state.step += 1
                self.state.batch_in_epoch += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", step_s=f"{step_times[-1]:.3f}")
                if cfg.eval_every and self.state.step % cfg.eval_every == 0:
                    point = {"step": self.state.step, "train_loss": loss, **self.evaluate()}
                    self.state.curve.append(point)
                    self._log_scalars("eval", point)
                if cfg.checkpoint_every and self.state.step % cfg.checkpoint_every == 0:
                    self.save()
            if (
                self.state.batch_in_epoch >= self.steps_per_epoch
                or self.state.step >= self.total_steps
            ):
                record = self._end_epoch(
                    epoch, losses, step_times, time.perf_counter() - epoch_start
                )
                if bar is not None:
                    bar.write(_format_epoch(record))
                elif pdist.is_main():
                    logger.info("%s", _format_epoch(record))
                self._log_scalars("epoch", record)
                losses, step_times = [], []
                if self.state.batch_in_epoch >= self.steps_per_epoch:
                    self.state.epoch += 1
                    self.state.batch_in_epoch = 0
                self.save()
        if bar is not None:
            bar.close()
        if cfg.trace:
            path = tracer.save(cfg.trace)
            if path is not None:
                logger.info("plait: trace of %d rank(s) written to %s", self.world, path)
        if cfg.out and pdist.is_main():
            Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.out).write_text(json.dumps(self.summary(), indent=2))
        return self.state

    # ----------------------------------------------------------- TensorBoard
    def _log_step(self, loss: float, step_s: float, sent: float) -> None:
        """Rank 0's per-step scalars: loss, step time, throughput and the bytes it sent
        (`sent`, under the ring algorithms' cost, `plait.comm.stats`)."""
        if self.tensorboard is None:
            return
        step = self.state.step + 1  # the step just taken, counted from 1
        samples = self.batch_size * self.cfg.accumulate * self.world
        self.tensorboard.add_scalar("train/loss", loss, step)
        self.tensorboard.add_scalar("train/step_time_s", step_s, step)
        self.tensorboard.add_scalar("train/samples_per_s", samples / step_s, step)
        self.tensorboard.add_scalar("comm/bytes_per_step", sent, step)

    def _log_scalars(self, section: str, record: dict[str, Any]) -> None:
        """Every finite number of an epoch or evaluation record, under `section`/."""
        if self.tensorboard is None:
            return
        for key, value in record.items():
            if key in ("epoch", "step") or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                self.tensorboard.add_scalar(f"{section}/{key}", value, self.state.step)
        self.tensorboard.flush()

    def _end_epoch(
        self, epoch: int, losses: list[float], step_times: list[float], wall_s: float
    ) -> dict[str, Any]:
        metrics = self.evaluate()
        median = statistics.median(step_times) if step_times else math.nan
        samples = self.batch_size * self.cfg.accumulate * self.world
        record = {
            "epoch": epoch,
            "step": self.state.step,
            "train_loss": float(np.mean(losses)) if losses else math.nan,
            **metrics,
            "step_time_s": median,
            "samples_per_s": samples / median if step_times else math.nan,
            "epoch_time_s": wall_s,
        }
        self.state.history.append(record)
        return record

    def summary(self) -> dict[str, Any]:
        last = self.state.history[-1] if self.state.history else {}
        return {
            "workload": self.cfg.workload,
            "strategy": self.strategy.describe(),
            "world_size": self.world,
            "batch_size": self.batch_size,
            "data": self.data.name,
            "steps": self.state.step,
            "resumed_from": self.resumed_from,
            "final": last,
            "history": self.state.history,
            "curve": self.state.curve,
            "comm_calls": comm_stats.calls,
            "step_end_unix": self.step_end_unix,
            "step_losses": self.step_losses,
            "crossover": None if self.crossover is None else self.crossover.stats.as_dict(),
        }

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.crossover is not None:
            self.crossover.close()
        self.strategy.close()


def _format_epoch(r: dict[str, Any]) -> str:
    parts = [f"epoch {r['epoch']:3d}", f"step {r['step']:6d}", f"train_loss {r['train_loss']:.4f}"]
    if "test_loss" in r:
        parts += [f"test_loss {r['test_loss']:.4f}", f"test_acc {100 * r['test_accuracy']:.2f}%"]
    parts += [f"{r['samples_per_s']:.1f} samples/s", f"step {1000 * r['step_time_s']:.0f} ms"]
    return " | ".join(parts)


def _progress(total: int, initial: int, *, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    # on stderr, beside the logs, and only on a terminal: a redirected output gets the
    # epoch lines, not a bar's carriage returns
    return tqdm(
        total=total,
        initial=initial,
        desc="train",
        unit="step",
        file=sys.stderr,
        disable=None,
        dynamic_ncols=True,
        mininterval=0.5,
    )


def train(config: TrainConfig) -> dict[str, Any]:
    """Initialise distributed (if launched so), train, and return the summary."""
    pdist.init_distributed()
    # a lost peer ends the run as a CollectiveError, whichever collective saw it first
    with collective_errors("training"):
        trainer = Trainer(config)
        try:
            trainer.run()
            return trainer.summary()
        finally:
            trainer.close()
