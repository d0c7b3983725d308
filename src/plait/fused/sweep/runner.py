"""Fused hyper-parameter sweeps on Optuna's ask/tell interface.

The loop asks Optuna for trials and pools them by their non-fusible hyper-parameters;
a pool trains as one fused array once it holds N trials, N being the largest array that
fits in memory (found once per pool by doubling and bisection). After every epoch each
trial reports its validation accuracy; a trial the pruner stops, or one that diverges,
leaves its array (`keep`) while the others train on. The study lives in Optuna storage
(SQLite under runs/ by default; any RDB URL lets several machines share one sweep).

A sweep that dies (killed, or its machine lost) leaves the trials it had asked RUNNING in
the storage, where nothing would ever finish them. Every asked trial therefore records
its owner (host, pid and the pid's start time) and a heartbeat, refreshed while it waits
and trains; a sweep that starts on the study first marks FAIL every RUNNING trial whose
owner is gone (a dead process on this host, or no heartbeat for `STALE_AFTER_S` from
another host) and asks their configurations again, so the study still reaches its
number of trials. Trials of a live sweep sharing the study are left alone.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import optuna
import torch
from torch import nn
from torch.utils.data import TensorDataset
from tqdm import tqdm

from plait._proc import pid_alive
from plait.fused.convert import fuse
from plait.fused.losses import cross_entropy
from plait.fused.lr_scheduler import CosineAnnealingLR
from plait.fused.optim import FusedOptimizer
from plait.fused.sweep.capacity import available_memory, largest_fitting, step_memory
from plait.fused.sweep.space import Space
from plait.fused.sweep.storage import mask_secrets, mask_url, storage_url
from plait.fused.sweep.task import OptimizerKind, SweepTask, sweep_task
from plait.workloads import DataInfo, Workload, logits_of

log = logging.getLogger(__name__)

#: Trial system attributes: the process that asked the trial, its last sign of life (wall
#: clock), and the mark of a trial failed because its sweep died (asked again elsewhere).
OWNER_ATTR = "plait:owner"
HEARTBEAT_ATTR = "plait:heartbeat"
INTERRUPTED_ATTR = "plait:interrupted"
#: User attribute of a trial that trains again the configuration of an interrupted one.
RETRY_ATTR = "plait:retry_of"
#: How often a sweep refreshes the heartbeat of the trials it holds.
HEARTBEAT_INTERVAL_S = 30.0
#: A RUNNING trial of another host whose heartbeat is older than this is taken for dead.
STALE_AFTER_S = 600.0


class PrunerKind(StrEnum):
    MEDIAN = "median"  # stop a trial below the median of completed trials at that epoch
    ASHA = "asha"  # successive halving: compares trials running at the same time too
    NONE = "none"


class SamplerKind(StrEnum):
    TPE = "tpe"
    RANDOM = "random"


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """How a sweep runs.

    Attributes:
        trials: total trials of the study (across every process sharing it).
        epochs: training epochs per trial.
        study: Optuna study name (default: the workload's name).
        storage: Optuna storage URL (default: SQLite file runs/plait-sweeps.db).
        max_models: the largest array to try; the memory search stays below it.
        memory_budget: bytes one array may use (default: half the available memory on a
            CPU, 90% of the free memory on a GPU).
        pruner, sampler: an Optuna pruner and sampler, by name (`PrunerKind`,
            `SamplerKind`) or as objects (any `optuna.pruners.BasePruner` /
            `optuna.samplers.BaseSampler`, configured as the user likes).
        optimizer: the fused optimizer every array trains with; a trial's optimizer
            options (lr, momentum, betas, ...) come from the search space, per model.
        warmup_epochs: epochs before the median pruner may stop a trial.
        seed: seeds the named sampler, every trial's initial weights and the data order.
        device: "cpu" or "cuda".
        progress: show progress bars and per-epoch lines of every trial.
    """

    trials: int = 32
    epochs: int = 10
    study: str | None = None
    storage: str | None = None
    max_models: int = 64
    memory_budget: int | None = None
    pruner: PrunerKind | optuna.pruners.BasePruner = PrunerKind.MEDIAN
    sampler: SamplerKind | optuna.samplers.BaseSampler = SamplerKind.TPE
    optimizer: OptimizerKind = OptimizerKind.SGD
    warmup_epochs: int = 2
    seed: int = 0
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.trials < 1 or self.epochs < 1 or self.max_models < 1:
            raise ValueError("trials, epochs and max_models must be >= 1")
        # Names become their enums here, so a typo fails before any study is opened.
        for attr, kind, base, extra in (
            ("pruner", PrunerKind, optuna.pruners.BasePruner, ", or an optuna pruner"),
            ("sampler", SamplerKind, optuna.samplers.BaseSampler, ", or an optuna sampler"),
            ("optimizer", OptimizerKind, None, ""),
        ):
            value = getattr(self, attr)
            if base is not None and isinstance(value, base):
                continue
            try:
                object.__setattr__(self, attr, kind(value))
            except ValueError:
                accepted = ", ".join(k.value for k in kind)
                raise ValueError(f"{attr} {value!r}: choose from {accepted}{extra}") from None


@dataclass
class TrialRecord:
    """One trial's outcome: its curve is the validation accuracy after each epoch."""

    number: int
    params: dict[str, Any]
    state: str
    value: float | None
    curve: list[float]
    array: int
    array_size: int


@dataclass
class SweepResult:
    """A sweep's trials; `storage` is the study's URL with any password masked."""

    study: str
    storage: str
    records: list[TrialRecord] = field(default_factory=list)
    capacities: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def best(self) -> TrialRecord | None:
        done = [r for r in self.records if r.state == "COMPLETE" and r.value is not None]
        return max(done, key=lambda r: r.value or 0.0, default=None)


def _pruner(cfg: SweepConfig) -> optuna.pruners.BasePruner:
    if isinstance(cfg.pruner, optuna.pruners.BasePruner):
        return cfg.pruner
    if cfg.pruner is PrunerKind.MEDIAN:
        return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=cfg.warmup_epochs)
    if cfg.pruner is PrunerKind.ASHA:
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    return optuna.pruners.NopPruner()


def _sampler(cfg: SweepConfig) -> optuna.samplers.BaseSampler:
    if isinstance(cfg.sampler, optuna.samplers.BaseSampler):
        return cfg.sampler
    if cfg.sampler is SamplerKind.RANDOM:
        return optuna.samplers.RandomSampler(seed=cfg.seed)
    return optuna.samplers.TPESampler(seed=cfg.seed)


def _tensors(dataset: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a dataset of (input, target) samples, stacked once."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        x, y = dataset.tensors
        return x, y
    samples = [dataset[i] for i in range(len(dataset))]
    if not samples:
        raise ValueError(f"the {what} data is empty")
    try:
        x = torch.stack([torch.as_tensor(s[0]) for s in samples])
        y = torch.stack([torch.as_tensor(s[1]) for s in samples])
    except (TypeError, IndexError, RuntimeError) as e:
        raise ValueError(
            f"the {what} data must hold (input, target) samples of equal shapes: {e}"
        ) from None
    return x, y


#: Share of the training data held out to score trials when a workload has no test set.
HOLDOUT = 0.2


class _Data:
    """Train and validation tensors on the device, batches in a per-epoch seeded order.

    A sweep trains small models on small data: the whole data set sits on the device as
    two tensors, so a batch is one index, whichever array asks for it.
    """

    def __init__(self, task: SweepTask, device: str) -> None:
        split = task.workload.real()
        self.info: DataInfo = split.info
        x, y = _tensors(split.train, "training")
        if split.test is not None:
            vx, vy = _tensors(split.test, "held-out")
        else:
            n = max(1, int(len(x) * HOLDOUT))
            if n >= len(x):
                raise ValueError(f"workload {task.name!r}: too little data to hold out any")
            log.info(
                "workload %r has no test set: %d training samples score the trials", task.name, n
            )
            x, y, vx, vy = x[:-n], y[:-n], x[-n:], y[-n:]
        self.x, self.y, self.vx, self.vy = (t.to(device) for t in (x, y, vx, vy))

    def batches(
        self, batch_size: int, *, seed: int, epoch: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The order depends on (seed, epoch) only: a trial sees the same data whichever
        # array it trains in, as it would alone.
        g = torch.Generator().manual_seed(seed * 7919 + epoch)
        perm = torch.randperm(len(self.x), generator=g).to(self.x.device)
        for i in range(0, len(perm), batch_size):
            idx = perm[i : i + batch_size]
            yield self.x[idx], self.y[idx]

    def steps(self, batch_size: int) -> int:
        return math.ceil(len(self.x) / batch_size)


def _models(
    task: SweepTask,
    params: Sequence[dict[str, Any]],
    numbers: Sequence[int],
    cfg: SweepConfig,
    info: DataInfo,
) -> list[nn.Module]:
    models = []
    for p, n in zip(params, numbers, strict=True):
        torch.manual_seed(cfg.seed * 1_000_003 + n)  # a trial's weights depend on its number
        models.append(task.build(info, p, cfg.optimizer))
    return models


def _optimizer(
    array: nn.Module, params: Sequence[dict[str, Any]], cfg: SweepConfig
) -> FusedOptimizer:
    return cfg.optimizer.make(array.parameters(), params)


def _one(output: Any, b: int) -> Any:
    """Model b's output of an array's output (a tensor, a dict or a ModelOutput of them)."""
    if isinstance(output, torch.Tensor):
        return output[b]
    if isinstance(output, Mapping):
        return {k: v[b] if isinstance(v, torch.Tensor) else v for k, v in output.items()}
    return logits_of(output)[b]


def _losses(workload: Workload, output: Any, y: torch.Tensor) -> torch.Tensor:
    """[B] per-model losses: one fused cross-entropy, or the workload's loss per model."""
    if workload.loss_fn is None:
        return cross_entropy(logits_of(output), y)  # classes, or tokens of a language model
    return torch.stack([workload.loss_fn(_one(output, b), y) for b in range(_count(output))])


def _scores(workload: Workload, output: Any, y: torch.Tensor) -> list[tuple[int, int]]:
    """(correct, total) of each model."""
    if workload.metric_fn is None:
        logits = logits_of(output)
        hits = logits.argmax(-1) == y.expand(logits.shape[0], *y.shape)
        return [(int(c), y.numel()) for c in hits.flatten(1).sum(1)]
    return [workload.metric_fn(_one(output, b), y) for b in range(_count(output))]


def _count(output: Any) -> int:
    return int(logits_of(output).shape[0])


def train_array(
    task: SweepTask,
    trials: Sequence[optuna.trial.Trial],
    params: Sequence[dict[str, Any]],
    *,
    data: _Data,
    cfg: SweepConfig,
    study: optuna.Study,
    array_id: int,
    heartbeat: Callable[[], None] | None = None,
) -> list[TrialRecord]:
    """Train `trials` as one fused array; report, prune and tell each one.

    `heartbeat` is called after every step, so the sweep can show the storage that the
    trials it holds are alive (it throttles the writes itself).
    """
    b = len(trials)
    batch_size = int(params[0].get("batch_size", 32))
    models = _models(task, params, [t.number for t in trials], cfg, data.info)
    array = fuse(models, fallback="vmap").to(cfg.device)
    opt = _optimizer(array, params, cfg)
    sched = CosineAnnealingLR(opt, T_max=cfg.epochs * data.steps(batch_size))
    active = list(range(b))
    curves: list[list[float]] = [[] for _ in range(b)]
    states = ["RUNNING"] * b
    shared = ", ".join(f"{k}={v}" for k, v in task.partition_key(params[0], cfg.optimizer))
    bar = tqdm(
        total=cfg.epochs * data.steps(batch_size),
        disable=not cfg.progress,
        leave=False,
        desc=f"array {array_id}: {b} trials ({shared})",
        unit="step",
    )
    for epoch in range(cfg.epochs):
        array.train()
        losses = torch.zeros(len(active))
        for x, y in data.batches(batch_size, seed=cfg.seed, epoch=epoch):
            losses = _losses(task.workload, array(x.expand(len(active), *x.shape)), y)
            opt.zero_grad(set_to_none=True)
            losses.sum().backward()  # each model's gradient is its own loss's
            opt.step()
            sched.step()
            bar.update(1)
            if heartbeat is not None:
                heartbeat()
        acc = _evaluate(task.workload, array, data, len(active))
        drop: list[int] = []
        for j, i in enumerate(active):
            trial = trials[i]
            curves[i].append(acc[j])
            if not math.isfinite(float(losses[j].detach())):
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                states[i] = "FAIL"
                drop.append(j)
                continue
            trial.report(acc[j], epoch)
            if epoch + 1 < cfg.epochs and trial.should_prune():
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                states[i] = "PRUNED"
                drop.append(j)
        if cfg.progress:
            tqdm.write(
                _epoch_line(
                    array_id, epoch, epochs=cfg.epochs, trials=trials, curves=curves, states=states
                )
            )
        if len(drop) == len(active):
            break
        if drop:  # pruned trials leave the array; the others train on without them
            keep = [j for j in range(len(active)) if j not in drop]
            array.keep(keep)
            opt.keep(keep)
            sched.keep(keep)
            active = [active[j] for j in keep]
    bar.close()
    for i in active:
        if states[i] == "RUNNING":
            study.tell(trials[i], curves[i][-1])
            states[i] = "COMPLETE"
    records = [
        TrialRecord(
            number=t.number,
            params=dict(p),
            state=s,
            value=c[-1] if s == "COMPLETE" else None,
            curve=c,
            array=array_id,
            array_size=b,
        )
        for t, p, s, c in zip(trials, params, states, curves, strict=True)
    ]
    if cfg.progress:
        for r in records:
            value = (
                f"{r.value:.4f}" if r.value is not None else f"stopped after epoch {len(r.curve)}"
            )
            tqdm.write(f"trial #{r.number} {r.state.lower()}: {value} ({_fmt_params(r.params)})")
    return records


@torch.no_grad()
def _evaluate(workload: Workload, array: nn.Module, data: _Data, b: int) -> list[float]:
    """Each model's held-out metric, in chunks so that a large test set fits."""
    array.eval()
    correct, total = [0] * b, [0] * b
    for i in range(0, len(data.vx), EVAL_CHUNK):
        vx, vy = data.vx[i : i + EVAL_CHUNK], data.vy[i : i + EVAL_CHUNK]
        for j, (c, t) in enumerate(_scores(workload, array(vx.expand(b, *vx.shape)), vy)):
            correct[j] += c
            total[j] += t
    return [c / max(t, 1) for c, t in zip(correct, total, strict=True)]


#: Held-out samples per evaluation forward pass.
EVAL_CHUNK = 2048


def _fmt_params(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
    )


def _epoch_line(
    array_id: int,
    epoch: int,
    *,
    epochs: int,
    trials: Sequence[optuna.trial.Trial],
    curves: list[list[float]],
    states: list[str],
) -> str:
    parts = []
    for t, c, s in zip(trials, curves, states, strict=True):
        if s == "RUNNING" or len(c) == epoch + 1:
            parts.append(f"#{t.number} {c[-1]:.3f}" + ("" if s == "RUNNING" else f" {s.lower()}"))
    lines = [f"array {array_id} epoch {epoch + 1}/{epochs}:"]
    for i in range(0, len(parts), 8):
        lines.append("  " + "  ".join(parts[i : i + 8]))
    return "\n".join(lines)


def _capacity(task: SweepTask, params: dict[str, Any], data: _Data, cfg: SweepConfig) -> int:
    """The largest array for trials like `params` that fits the memory budget."""
    batch_size = int(params.get("batch_size", 32))
    x, y = data.x[:batch_size], data.y[:batch_size]
    if cfg.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        budget = cfg.memory_budget or int(0.9 * free)
    else:
        budget = cfg.memory_budget or available_memory() // 2

    def fits(n: int) -> bool:
        models = _models(task, [params] * n, list(range(n)), cfg, data.info)
        array = fuse(models, fallback="vmap").to(cfg.device)
        opt = _optimizer(array, [params] * n, cfg)

        def step() -> None:
            _losses(task.workload, array(x.expand(n, *x.shape)), y).sum().backward()
            opt.step()

        def state() -> list[torch.Tensor]:
            return [
                t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
            ]

        try:
            if cfg.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
                step()
                used = torch.cuda.max_memory_allocated()
            else:
                used = step_memory(step, params=list(array.parameters()), state=state)
        except torch.OutOfMemoryError:
            return False
        return used <= budget

    return largest_fitting(fits, limit=cfg.max_models)


def delete_study(name: str, storage: str | None) -> bool:
    """Delete study `name` from `storage` if it exists (True when it did)."""
    url = storage_url(storage)
    try:
        optuna.delete_study(study_name=name, storage=url)
    except KeyError:
        return False
    except Exception as exc:
        raise ValueError(
            f"cannot open Optuna storage {mask_url(url)}: {mask_secrets(str(exc), url)}"
        ) from None
    return True


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), to tell it from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


def _owner_gone(trial: optuna.trial.FrozenTrial, host: str, now: float) -> str | None:
    """Why the sweep that asked RUNNING `trial` is known to be gone, or None if it may live."""
    owner = trial.system_attrs.get(OWNER_ATTR)
    if isinstance(owner, dict) and owner.get("host") == host:
        pid = int(owner.get("pid", 0))
        if not pid_alive(pid):
            return f"its process {pid} on this host has exited"
        started = owner.get("start")
        if started is not None and _start_ticks(pid) not in {None, started}:
            return f"its process {pid} on this host has exited (the pid was reused)"
        return None
    beat = trial.system_attrs.get(HEARTBEAT_ATTR)
    last = float(beat) if isinstance(beat, int | float) else None
    if last is None and trial.datetime_start is not None:
        last = trial.datetime_start.timestamp()
    if last is not None and now - last > STALE_AFTER_S:
        where = owner.get("host") if isinstance(owner, dict) else "an unknown host"
        return f"no sign of life from {where} for {now - last:.0f}s"
    return None


def recover_interrupted(study: optuna.Study) -> list[int]:
    """Fail the RUNNING trials whose sweep is gone and ask their configurations again.

    Each such trial is marked FAIL (with `INTERRUPTED_ATTR`, so it does not count towards
    the study's trials) and its parameters are enqueued, so the next `ask` trains the same
    configuration. When several sweeps recover at once, the storage lets only one of them
    fail a given trial, and only that one enqueues it.

    Returns:
        The numbers of the trials failed here.
    """
    storage, host, now = study._storage, socket.gethostname(), time.time()
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        why = _owner_gone(trial, host, now)
        if why is None:
            continue
        try:
            storage.set_trial_system_attr(trial._trial_id, INTERRUPTED_ATTR, True)
            if not storage.set_trial_state_values(
                trial._trial_id, state=optuna.trial.TrialState.FAIL
            ):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # another sweep finished or failed it first
        study.enqueue_trial(trial.params, user_attrs={RETRY_ATTR: trial.number})
        failed.append(trial.number)
        log.warning(
            "trial #%d was left RUNNING by a sweep that is gone (%s): marked FAIL, its "
            "configuration will be trained again",
            trial.number,
            why,
        )
    return failed


def _counted(study: optuna.Study) -> int:
    """Trials that count towards the study's total: all but those waiting to be asked and
    those failed because their sweep died (their configurations are asked again)."""
    return sum(
        1
        for t in study.get_trials(deepcopy=False)
        if t.state != optuna.trial.TrialState.WAITING and not t.system_attrs.get(INTERRUPTED_ATTR)
    )


class _Holder:
    """The trials this sweep has asked and not yet told: their owner mark and heartbeat."""

    def __init__(self, study: optuna.Study) -> None:
        self.study = study
        pid = os.getpid()
        self.owner: dict[str, Any] = {
            "host": socket.gethostname(),
            "pid": pid,
            "start": _start_ticks(pid),
        }
        self.trials: dict[int, optuna.trial.Trial] = {}
        self.last = 0.0

    def claim(self, trial: optuna.trial.Trial) -> None:
        storage = self.study._storage
        storage.set_trial_system_attr(trial._trial_id, OWNER_ATTR, self.owner)
        storage.set_trial_system_attr(trial._trial_id, HEARTBEAT_ATTR, time.time())
        self.trials[trial.number] = trial

    def beat(self) -> None:
        """Refresh the heartbeat of every held trial, at most every HEARTBEAT_INTERVAL_S."""
        now = time.monotonic()
        if now - self.last < HEARTBEAT_INTERVAL_S:
            return
        self.last = now
        storage, wall = self.study._storage, time.time()
        for number, trial in list(self.trials.items()):
            try:
                storage.set_trial_system_attr(trial._trial_id, HEARTBEAT_ATTR, wall)
            except optuna.exceptions.UpdateFinishedTrialError:
                del self.trials[number]

    def done(self, trials: Sequence[optuna.trial.Trial]) -> None:
        for trial in trials:
            self.trials.pop(trial.number, None)

    def abandon(self) -> None:
        """The sweep is stopping early: fail its open trials and ask them again later."""
        storage = self.study._storage
        for trial in self.trials.values():
            with contextlib.suppress(Exception):
                storage.set_trial_system_attr(trial._trial_id, INTERRUPTED_ATTR, True)
                if storage.set_trial_state_values(
                    trial._trial_id, state=optuna.trial.TrialState.FAIL
                ):
                    self.study.enqueue_trial(
                        trial.params, user_attrs={"plait:retry_of": trial.number}
                    )
        self.trials.clear()


#: Errors of a storage that another process is setting up at the same moment (two sweeps
#: started together on a new SQLite file: one of them meets "table ... already exists").
_RACY_STORAGE_ERRORS = ("already exists", "database is locked", "UNIQUE constraint failed")
_OPEN_ATTEMPTS = 5


def _open_study(name: str, storage: str, cfg: SweepConfig) -> optuna.Study:
    """Create or load the study; a race with another process creating it is retried."""
    for attempt in range(_OPEN_ATTEMPTS):
        try:
            return optuna.create_study(
                study_name=name,
                storage=storage,
                direction="maximize",
                sampler=_sampler(cfg),
                pruner=_pruner(cfg),
                load_if_exists=True,
            )
        except Exception as exc:
            racy = any(text in str(exc) for text in _RACY_STORAGE_ERRORS)
            if racy and attempt + 1 < _OPEN_ATTEMPTS:
                log.debug("storage busy (%s): opening the study again", type(exc).__name__)
                time.sleep(0.2 * (attempt + 1))
                continue
            # Errors of the storage layer may quote the URL, password included.
            raise ValueError(
                f"cannot open Optuna storage {mask_url(storage)}: {mask_secrets(str(exc), storage)}"
            ) from None
    raise AssertionError("unreachable")  # the loop returns or raises


def check_space(
    task: SweepTask, optimizer: OptimizerKind | str = OptimizerKind.SGD
) -> dict[str, Any]:
    """Sample the task's space once on a throwaway in-memory trial and check its names.

    A misspelt or unusable hyper-parameter then fails before any storage, study or model
    exists. Returns the sampled parameters.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    probe = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    params = task.suggest(probe)
    task.check(params, OptimizerKind(optimizer))
    return params


def run_sweep(
    task: SweepTask | Workload | str, cfg: SweepConfig, *, space: Space | None = None
) -> SweepResult:
    """Run (or continue) the study until it holds `cfg.trials` trials.

    Trials left RUNNING by a sweep that died are failed and their configurations trained
    again (`recover_interrupted`); they do not count towards `cfg.trials`.

    Args:
        task: a `SweepTask`, or a workload (registry name, ``pkg.module:factory``,
            ``file.py:factory`` or `Workload`) swept over `space`.
        cfg: how the sweep runs (trials, epochs, storage, optimizer, sampler, pruner...).
        space: ``space(trial) -> dict`` of hyper-parameters; replaces the task's space
            (default: `SearchSpace()`).

    Raises:
        ValueError: an unknown workload, a space returning a name that neither the
            optimizer nor the model builder takes, storage that does not open, or no
            model that fits the memory budget.
    """
    task = sweep_task(task, space)
    check_space(task, cfg.optimizer)
    storage = storage_url(cfg.storage)
    name = cfg.study or task.name
    study = _open_study(name, storage, cfg)
    log.info("sweep %r in %s", name, mask_url(storage))
    recover_interrupted(study)
    already = _counted(study)
    if already >= cfg.trials:
        log.warning(
            "study %r already holds %d trial(s), all that %d asks for: nothing to run; "
            "ask for more trials to continue it, delete it to start afresh (plait sweep "
            "--restart), or name another study",
            name,
            already,
            cfg.trials,
        )
    data = _Data(task, cfg.device)
    result = SweepResult(study=name, storage=mask_url(storage))
    capacities: dict[Any, int] = {}
    pools: dict[Any, list[tuple[optuna.trial.Trial, dict[str, Any]]]] = {}
    holder = _Holder(study)
    start = time.perf_counter()
    array_id = 0

    def train(key: Any) -> None:
        nonlocal array_id
        pool = pools.pop(key)
        array_id += 1
        trials = [t for t, _ in pool]
        result.records.extend(
            train_array(
                task,
                trials,
                [p for _, p in pool],
                data=data,
                cfg=cfg,
                study=study,
                array_id=array_id,
                heartbeat=holder.beat,
            )
        )
        holder.done(trials)

    # Ask trials one by one into pools of equal non-fusible values; a pool trains as one
    # array as soon as it reaches the largest size that fits (the sampler then sees its
    # results), and whatever is left trains once the study has all its trials.
    try:
        while cfg.trials - _counted(study) > 0:
            trial = study.ask()
            holder.claim(trial)
            params = task.suggest(trial)
            try:
                task.check(params, cfg.optimizer)
            except ValueError:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                holder.done([trial])
                raise
            key = task.partition_key(params, cfg.optimizer)
            if key not in capacities:
                capacities[key] = _capacity(task, params, data, cfg)
                result.capacities[", ".join(f"{k}={v}" for k, v in key) or "all"] = capacities[key]
                if cfg.progress:
                    tqdm.write(
                        f"largest array that fits ({dict(key) or 'all trials'}): "
                        f"{capacities[key]} models (limit {cfg.max_models})"
                    )
            pools.setdefault(key, []).append((trial, params))
            holder.beat()
            if len(pools[key]) >= capacities[key]:
                train(key)
        for key in list(pools):
            train(key)
    except BaseException:
        holder.abandon()
        raise
    result.elapsed_s = time.perf_counter() - start
    return result
