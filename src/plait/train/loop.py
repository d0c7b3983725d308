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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from plait import comm
from plait import distributed as pdist
from plait.comm import stats as comm_stats
from plait.comm.ops import collective_errors
from plait.crossover.scheduler import Crossover, attach
from plait.log import summary_writer
from plait.trace import COMPUTE, OPTIM, span, tracer
from plait.train.checkpoint import Checkpointer, has_sharded, load_sharded
from plait.train.config import OPTIMIZERS, TrainConfig
from plait.train.optim import MuonAdamW, heavyball_soap
from plait.train.strategy import Strategy
from plait.workloads import DataSplit, Workload, get_workload

logger = logging.getLogger(__name__)


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
    if name == "muon-fp32":  # the same, its Newton-Schulz iteration in float32
        return MuonAdamW(params, lr=lr, weight_decay=weight_decay, ns_dtype=torch.float32)
    if name == "heavyball-soap":
        return heavyball_soap(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's random states (torch, Python, NumPy): what a checkpoint keeps, and
    what `plait race` saves and restores to interleave several trainers on one process."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the random states `rng_state` returned."""
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
        optimizer_name = config.optimizer or self.wl.optimizer

        def make_optimizer(params: Any) -> torch.optim.Optimizer:
            return build_optimizer(
                optimizer_name,
                params,
                lr=config.lr or self.wl.lr,
                momentum=config.momentum,
                weight_decay=config.weight_decay,
            )

        self.strategy.bind_data(
            (sample[0].to(self.device), sample[1].to(self.device)),
            global_batch=self.batch_size * self.world,
        )
        self.strategy.bind_optimizer(make_optimizer, name=optimizer_name)
        self.model = self.strategy.wrap(model)
        # the global batch is batch_size x world whatever the strategy; ranks that share a
        # data shard (tensor/pipeline parallel) split it among fewer readers
        self.dp_rank = self.strategy.data_parallel_rank()
        self.dp_size = self.strategy.data_parallel_size()
        self.loader_batch = self.batch_size * self.world // self.dp_size
        self.optimizer = self.strategy.build_optimizer(self.model, make_optimizer)
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
        local = {"strategy": self.strategy.state_dict(), "rng": rng_state()}
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
            set_rng_state(local["rng"])
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
    def batches(self, epoch: int, skip: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's shard of epoch `epoch`'s training data, in the order `run` trains on
        it, from its `skip`-th optimizer step (a resumed epoch)."""
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

    def stream(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches epoch after epoch from the first, as `run` would meet them
        without restarts (`plait race` steps several trainers through their streams)."""
        epoch = 0
        while True:
            yield from self.batches(epoch)
            epoch += 1

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
        loss_sum, hits, total = comm.reduce_floats(sums.tolist(), name="evaluate")
        return {"test_loss": loss_sum / total, "test_accuracy": hits / total}

    def run(self) -> TrainState:
        cfg = self.cfg
        self.maybe_resume()
        bar = _progress(self.total_steps, self.state.step, enabled=cfg.progress and pdist.is_main())
        step_times: list[float] = []
        losses: list[float] = []
        while self.state.step < self.total_steps:
            epoch = self.state.epoch
            batches = self.batches(epoch, self.state.batch_in_epoch)
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
