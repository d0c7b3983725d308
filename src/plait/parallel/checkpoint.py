"""Distributed checkpoints that reload under a different plan.

Model and optimizer state are saved with `torch.distributed.checkpoint` (every rank writes
its own shards, in parallel) under the *original model's* parameter names: pipeline stages
keep their keys (`StageModule`), FSDP2 and tensor parallelism keep theirs, and optimizer
state is flattened per parameter (``state.<name>.exp_avg``), so ZeRO-1's partitioned
optimizer, FSDP's sharded one and a replicated one all write the same keys. Loading
reshards whatever was saved into the layout of the plan that loads it: another degree,
another ZeRO stage, a pipeline, or a single process.

`save` writes a manifest (sizes and SHA-256 of every shard) once every rank's shards are
on disk, and `load` refuses a directory without a matching one, so a save cut short is
never mistaken for a checkpoint. Loading never runs code from the directory: the pickled
index is checked against the classes it legitimately holds, and non-tensor values load
with ``weights_only=True`` (`plait.persist.dcp_load_safe`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.optim import ZeroRedundancyOptimizer

from plait import comm
from plait import distributed as pdist
from plait.parallel.api import ParallelModel
from plait.persist import (
    MANIFEST,
    CheckpointError,
    dcp_load_safe,
    fsync_dir,
    read_manifest,
    write_manifest,
)

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeRO-1 keeps its partition inside)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        inner: torch.optim.Optimizer = optimizer.optim
        return inner
    return optimizer


def state_dict(model: ParallelModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of model and optimizer state, keyed by original names."""
    msd, osd = get_state_dict(model.state_module(), [_inner(optimizer)], options=_OPTIONS)
    return {"model": msd, "optim": osd}


def load_state_dict(
    model: ParallelModel, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Put `state` (shaped as `state_dict` of this model) into the model and optimizer."""
    set_state_dict(
        model.state_module(),
        [_inner(optimizer)],
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_OPTIONS,
    )


def save(
    path: str | os.PathLike[str], model: ParallelModel, optimizer: torch.optim.Optimizer
) -> None:
    """Collective: every rank writes its shards under `path`, then rank 0 the manifest.

    An earlier checkpoint at `path` is invalidated (its manifest removed) before any
    shard is overwritten.
    """
    root = Path(path)
    if pdist.is_main() and (root / MANIFEST).exists():
        (root / MANIFEST).unlink()
        fsync_dir(root)
    comm.barrier()
    dcp_save(state_dict(model, optimizer), checkpoint_id=str(root))
    comm.barrier()
    if pdist.is_main():
        write_manifest(root, step=0, world_size=pdist.world_size())
    comm.barrier()


def load(
    path: str | os.PathLike[str], model: ParallelModel, optimizer: torch.optim.Optimizer
) -> None:
    """Collective: load a checkpoint saved by any plan into this one.

    Raises:
        CheckpointError: `path` has no manifest or a file does not match it.
        UnsafeCheckpointError: the checkpoint would run code when loaded.
    """
    root = Path(path)
    try:
        read_manifest(root)
    except CheckpointError as exc:
        raise CheckpointError(f"cannot load the parallel checkpoint {root}: {exc}") from None
    state = state_dict(model, optimizer)  # the target layout; dcp fills it in place
    dcp_load_safe(state, root)
    load_state_dict(model, optimizer, state)
