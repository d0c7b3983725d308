"""The five ways to train N models that the benchmark compares, behind one interface.

- fused: `plait.fuse` + `FusedAdam` with per-model learning rates, one process (layers
  fused from torch.fx's trace, or from torch.export's graph where fx cannot trace);
- fallback: plait's vmap fallback, `VmapArray` + `FusedAdam`, the array a model runs as
  when it cannot be fused;
- serial: N stock models trained one after another in one process (stock Adam each);
- concurrent: N processes, one stock model each, running at the same time;
- vmap: the torch.func ensemble recipe (stack_module_state + functional_call + vmap)
  with torch's functional Adam (`torch.optim.adam.adam`) over the stacked weights (Adam
  is element-wise, so this is per-model Adam with one shared learning rate).

Models of any workload train on its loss: class logits or a language model's tokens,
read from a `ModelOutput`'s `logits` for models nobody here wrote (Hugging Face's).

The stock strategies' Adam is torch's fused implementation by default (`StockAdam`):
the fused array's `FusedAdam` runs that same kernel, so the comparison measures fusing
the models, not a faster optimizer. torch's default on CPU, a loop over parameters,
makes a small model's step up to 1.5x slower (the MLP's).

`run(steps)` trains every model `steps` steps and returns the wall time and the CPU
time it took (summed over the worker processes of the concurrent strategy). On a shared
machine the CPU time is the load-robust measure of work; the wall time includes the
parallelism of concurrent processes and whatever else the machine runs.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import time
from enum import StrEnum
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam

from plait.bench.core import Stopwatch
from plait.bench.fused.models import BenchModel, get_model
from plait.fused.convert import fuse
from plait.fused.losses import cross_entropy
from plait.fused.malloc import tune_malloc
from plait.fused.optim import FusedAdam
from plait.fused.vmap import VmapArray
from plait.workloads import logits_of

LR = 1e-3


class StockAdam(StrEnum):
    """Which implementation of `torch.optim.Adam` the stock strategies use."""

    FUSED = "fused"  # one kernel for all parameters, as `FusedAdam` uses
    FOREACH = "foreach"  # multi-tensor kernels
    FOR_LOOP = "for-loop"  # a loop over parameters: torch's default on CPU

    def make(self, params: Any) -> torch.optim.Adam:
        """Adam over `params` at the benchmark's learning rate."""
        if self is StockAdam.FUSED:
            return torch.optim.Adam(params, lr=LR, fused=True)
        return torch.optim.Adam(params, lr=LR, foreach=self is StockAdam.FOREACH)


class ArrayStrategy(StrEnum):
    FUSED = "fused"
    FALLBACK = "fallback"
    SERIAL = "serial"
    CONCURRENT = "concurrent"
    VMAP = "vmap"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Setup:
    """N models, their inputs and targets, shared by the in-process strategies."""

    def __init__(
        self, model: BenchModel, n: int, batch: int, device: str, *, adam: StockAdam, seed: int = 0
    ) -> None:
        self.adam = adam
        g = torch.Generator().manual_seed(seed)
        self.x = model.inputs(n, batch, g).to(device)
        self.y = model.targets(n, batch, g).to(device)
        torch.manual_seed(seed)
        self.models = [model.build().to(device) for _ in range(n)]
        self.device = device
        self.loss = model.workload.loss


class Runner:
    """Trains N models with one strategy; `run(steps)` returns (wall, CPU) seconds."""

    def run(self, steps: int) -> tuple[float, float]:
        with Stopwatch() as sw:
            self.train(steps)
        return sw.wall_s, sw.cpu_s

    def train(self, steps: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release processes or memory."""


class Fused(Runner):
    def __init__(self, setup: _Setup, *, fallback: bool = False) -> None:
        n = len(setup.models)
        self.array: nn.Module = VmapArray(setup.models) if fallback else fuse(setup.models)
        lrs = [LR * (1 + 0.01 * i) for i in range(n)]  # per-model rates cost nothing extra
        self.opt = FusedAdam(self.array.parameters(), lr=lrs)
        self.s = setup

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad()
            cross_entropy(logits_of(self.array(self.s.x)), self.s.y).sum().backward()
            self.opt.step()
        _sync(self.s.device)


class Serial(Runner):
    def __init__(self, setup: _Setup) -> None:
        self.models = setup.models
        self.opts = [setup.adam.make(m.parameters()) for m in self.models]
        self.s = setup

    def train(self, steps: int) -> None:
        for b, (m, opt) in enumerate(zip(self.models, self.opts, strict=True)):
            x, y = self.s.x[b], self.s.y[b]
            for _ in range(steps):
                opt.zero_grad()
                self.s.loss(m(x), y).backward()
                opt.step()
        _sync(self.s.device)


class Vmap(Runner):
    """torch.func's ensembling recipe with a functional Adam over the stacked weights.

    The template keeps the first model's tied parameters tied (a copy, not a move to the
    meta device, which unties them), so `functional_call` ties the stacked tensors the
    same way; one shared learning rate, as torch's Adam takes one.
    """

    def __init__(self, setup: _Setup) -> None:
        from torch.func import functional_call, stack_module_state, vmap

        params, buffers = stack_module_state(setup.models)
        self.params = [p.requires_grad_() for p in params.values()]
        self.names = list(params)
        self.buffers = buffers
        base = copy.deepcopy(setup.models[0])

        def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
            return logits_of(functional_call(base, (p, b), (x,)))

        self.forward = vmap(one, randomness="different")
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.steps = [torch.zeros(()) for _ in self.params]
        self.fused = setup.adam is StockAdam.FUSED  # the implementation the stock ones use
        self.foreach = setup.adam is StockAdam.FOREACH
        self.s = setup

    def train(self, steps: int) -> None:
        for _ in range(steps):
            for p in self.params:
                p.grad = None
            out = self.forward(dict(zip(self.names, self.params, strict=True)), self.buffers,
                               self.s.x)  # fmt: skip
            cross_entropy(out, self.s.y).sum().backward()
            with torch.no_grad():
                adam(
                    self.params, [p.grad for p in self.params], self.exp_avg,
                    self.exp_avg_sq, [], self.steps, foreach=self.foreach, fused=self.fused,
                    amsgrad=False, beta1=0.9, beta2=0.999, lr=LR, weight_decay=0.0, eps=1e-8,
                    maximize=False,
                )  # fmt: skip
        _sync(self.s.device)


def _worker(
    *,
    model_name: str,
    batch: int,
    threads: int,
    seed: int,
    device: str,
    tune: bool,
    adam: str,
    conn: Connection,
) -> None:
    """One process of the concurrent strategy: a stock model trained on command."""
    if tune:
        tune_malloc()
    torch.set_num_threads(threads)
    model = get_model(model_name)
    g = torch.Generator().manual_seed(seed)
    x = model.inputs(1, batch, g)[0].to(device)
    y = model.targets(1, batch, g)[0].to(device)
    torch.manual_seed(seed)
    m = model.build().to(device)
    opt = StockAdam(adam).make(m.parameters())
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        cpu = time.process_time()
        for _ in range(int(cmd)):
            opt.zero_grad()
            model.workload.loss(m(x), y).backward()
            opt.step()
        _sync(device)
        conn.send(time.process_time() - cpu)
    conn.close()


class Concurrent(Runner):
    """N worker processes (started from a fork server with torch preloaded)."""

    def __init__(
        self,
        model: BenchModel,
        n: int,
        *,
        batch: int,
        threads: int,
        device: str,
        tune: bool,
        adam: StockAdam,
    ) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "plait.bench.fused.strategies"])
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            kwargs = {
                "model_name": model.name,
                "batch": batch,
                "threads": threads,
                "seed": i,
                "device": device,
                "tune": tune,
                "adam": adam.value,
                "conn": child,
            }
            p = ctx.Process(target=_worker, kwargs=kwargs, daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(300):
                self.close()
                raise RuntimeError("a benchmark worker process did not start within 300 s")
            c.recv()

    def run(self, steps: int) -> tuple[float, float]:
        t = time.perf_counter()
        for c in self.conns:
            c.send(steps)
        cpu = 0.0
        for c in self.conns:
            if not c.poll(600):
                raise RuntimeError("a benchmark worker process did not answer within 600 s")
            cpu += float(c.recv())
        return time.perf_counter() - t, cpu

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                c.send(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        self.conns, self.procs = [], []


def make_runner(
    strategy: ArrayStrategy,
    model: BenchModel,
    n: int,
    *,
    batch: int,
    threads: int,
    device: str,
    tune: bool = False,
    adam: StockAdam = StockAdam.FUSED,
) -> Runner:
    if strategy is ArrayStrategy.CONCURRENT:
        return Concurrent(
            model, n, batch=batch, threads=threads, device=device, tune=tune, adam=adam
        )
    setup = _Setup(model, n, batch, device, adam=adam)
    if strategy in (ArrayStrategy.FUSED, ArrayStrategy.FALLBACK):
        return Fused(setup, fallback=strategy is ArrayStrategy.FALLBACK)
    if strategy is ArrayStrategy.SERIAL:
        return Serial(setup)
    return Vmap(setup)
