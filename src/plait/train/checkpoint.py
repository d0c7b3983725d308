"""Checkpoints that survive a killed worker, a full disk and a planted file.

A checkpoint is a directory ``step_XXXXXXXX/`` holding ``shared.pt`` (model, optimizer,
loop position: identical on every rank, written by rank 0), ``rank{r}.pt`` (each rank's
own state: compressor error buffers, K-FAC factors, random generators), optionally
``sharded/`` (torch.distributed.checkpoint shards of n-D parallel plans) and, written
last, ``MANIFEST.json``: the step, the world size, the format version and the size and
SHA-256 of every file. Every file is written to a temporary name, flushed to disk
(fsync) and renamed, and the directory is fsynced after the renames, so a crash or a
full disk at any moment leaves either the old state or the new one, never a mix.

A checkpoint counts only when its manifest exists and every file matches it. Resuming
walks the checkpoints newest first and takes the first that verifies; one that does not
(killed while saving, a truncated or garbled file) is skipped with a warning that says
what was wrong. A save that fails (ENOSPC, EIO, ...) on any rank fails on every rank with
a `CheckpointError` naming the rank and the cause, and the previous checkpoint is left
as it was.

The mechanism (plain state, atomic files, manifests, safe loading) is `plait.persist`;
this module is the policy on top. Nothing read back can run code: files are loaded with
``torch.load(weights_only=True)`` and plait stores only tensors, numbers, strings and
containers (`to_plain` turns NumPy arrays and enums into those before saving,
`from_plain` restores the arrays). The metadata that torch.distributed.checkpoint
pickles is checked against the classes it legitimately holds before it is unpickled, and
its non-tensor values load with ``weights_only=True`` as well. Checkpoints are written
and read on a file system that all ranks share (the emulated cluster's nodes share the
host's).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from plait import comm
from plait import distributed as pdist
from plait.persist import (
    MANIFEST,
    SHARDED,
    CheckpointError,
    dcp_load_safe,
    fsync_dir,
    read_manifest,
    safe_load,
    save_file,
    write_manifest,
)

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{8})$")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        if exc.errno == errno.ENOSPC:
            return f"the disk is full ({name}: {exc.strerror})"
        return f"{name}: {exc.strerror}" + (f" ({exc.filename})" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}"


def _agree(local_error: BaseException | None, what: str) -> None:
    """Collective: raise `CheckpointError` on every rank if any rank failed `what`.

    A rank that failed raises with its own error as the cause; the others raise too, so
    no rank waits in a later collective for one that gave up.
    """
    mine = None if local_error is None else _describe(local_error)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = comm.all_gather_object(mine, name=f"checkpoint {what}")
        failed = [(r, m) for r, m in enumerate(gathered) if m is not None]
    else:
        failed = [] if mine is None else [(0, mine)]
    if failed:
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise CheckpointError(f"{what} failed: {detail}") from local_error


# -------------------------------------------------------------- checkpointer
class Checkpointer:
    """Saves and finds checkpoints in `root`, keeping the newest `keep`.

    Args:
        root: checkpoint directory (created if missing).
        keep: complete checkpoints to retain (older ones are deleted by rank 0).
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def _dir(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def _steps(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            m = _STEP_RE.match(path.name)
            if m and path.is_dir() and not path.is_symlink():
                found.append((int(m.group(1)), path))
        return sorted(found)

    def complete(self) -> list[tuple[int, Path]]:
        """Checkpoints whose manifest exists (not verified: see `latest`), oldest first."""
        return [(s, p) for s, p in self._steps() if (p / MANIFEST).is_file()]

    def _latest_here(self) -> Path | None:
        good, _ = self._verified_here()
        return self.root / good[0] if good else None

    def _verified_here(self) -> tuple[list[str], list[str]]:
        """Complete checkpoints that verify (newest first), and why the others do not.

        A folder without a manifest (a save that did not finish) is neither.
        """
        good: list[str] = []
        bad: list[str] = []
        for step, path in reversed(self._steps()):
            if not (path / MANIFEST).is_file():
                logger.warning(
                    "skipping checkpoint %s: no %s (its save did not finish); trying an older one",
                    path,
                    MANIFEST,
                )
                continue
            try:
                manifest = read_manifest(path)
                if int(manifest["step"]) != step:
                    raise CheckpointError(f"{path.name}'s manifest is for step {manifest['step']}")
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %s: %s; trying an older one", path, exc)
                bad.append(str(exc))
                continue
            good.append(path.name)
        return good, bad

    def load_newest(self) -> tuple[Path, dict[str, Any], dict[str, Any] | None] | None:
        """Collective: load the newest checkpoint every rank can read and trust.

        Newest first, a checkpoint that fails its manifest on rank 0, or that any rank
        cannot load (`UnsafeCheckpointError`, an unreadable file), is skipped with a
        warning for the next older one, on every rank alike.

        Returns:
            The checkpoint's path, its shared state and this rank's local state (see
            `load`), or None when the folder holds no complete checkpoint.

        Raises:
            CheckpointError: complete checkpoints exist but none can be loaded. Starting
                from step 0 instead would let the first save delete them.
        """
        found: list[Any] = [None]
        if pdist.is_main():
            found[0] = self._verified_here()
        if dist.is_initialized() and dist.get_world_size() > 1:
            found[0] = comm.broadcast_object(found[0], src=0, name="checkpoints found")
        good, bad = found[0]
        for name in good:
            path = self.root / name
            error: BaseException | None = None
            loaded: tuple[dict[str, Any], dict[str, Any] | None] | None = None
            try:
                loaded = self.load(path)
            except CheckpointError as exc:
                error = exc
            try:
                _agree(error, f"loading {path}")
            except CheckpointError as exc:
                logger.warning("checkpoint %s refused (%s); trying an older one", path, exc)
                bad.append(str(exc))
                continue
            assert loaded is not None
            return path, loaded[0], loaded[1]
        if bad:
            raise CheckpointError(
                f"no checkpoint in {self.root} can be resumed ({'; '.join(bad)}); refusing "
                "to start from step 0, whose first save would delete them: move them away "
                "to start afresh"
            )
        return None

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies against its manifest, or None.

        Collective when distributed: rank 0 verifies and every rank gets its answer, so
        all ranks resume from the same step.
        """
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self._latest_here()
        choice: list[str | None] = [None]
        if pdist.is_main():
            found = self._latest_here()
            choice[0] = None if found is None else found.name
        choice[0] = comm.broadcast_object(choice[0], src=0, name="latest checkpoint")
        return None if choice[0] is None else self.root / choice[0]

    def save(
        self,
        step: int,
        *,
        shared: dict[str, Any],
        local: dict[str, Any],
        sharded: dict[str, Any] | None = None,
    ) -> Path:
        """Collective: every rank calls it with its own `local` state (and `sharded` shards).

        Raises:
            CheckpointError: writing failed on some rank (disk full, I/O error); every
                rank raises, the partial checkpoint is removed and older ones are intact.
            ValueError: the state holds objects a checkpoint cannot store (`to_plain`).
        """
        path = self._dir(step)
        try:
            self._write(step, path, shared=shared, local=local, sharded=sharded)
        except BaseException as exc:
            # a failed write, or a peer lost in one of the collectives: nothing half-written
            # stays behind to be taken for a checkpoint, and the older ones are untouched
            if pdist.is_main():
                shutil.rmtree(path, ignore_errors=True)
                prev = [p.name for s, p in self.complete() if s != step]
                kept = f"{prev[-1]} is intact" if prev else "there is no earlier checkpoint"
                logger.error("checkpoint at step %d not saved (%s); %s", step, exc, kept)
            raise
        if pdist.is_main():
            self._prune(step)
        comm.barrier()
        return path

    def _write(
        self,
        step: int,
        path: Path,
        *,
        shared: dict[str, Any],
        local: dict[str, Any],
        sharded: dict[str, Any] | None,
    ) -> None:
        error: BaseException | None = None
        if pdist.is_main():
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if path.is_dir():  # an earlier save of this step is replaced: unmark it first
                    with contextlib.suppress(FileNotFoundError):
                        (path / MANIFEST).unlink()
                    fsync_dir(path)
                path.mkdir(exist_ok=True)
                fsync_dir(self.root)
            except OSError as exc:
                error = exc
        _agree(error, f"checkpoint at step {step}: creating {path}")
        if sharded is not None:
            from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

            try:
                dcp_save(sharded, checkpoint_id=str(path / SHARDED))
            except Exception as exc:
                raise CheckpointError(
                    f"checkpoint at step {step}: sharded save failed: {exc}"
                ) from exc
        try:
            save_file(local, path / f"rank{pdist.rank()}.pt")
            if pdist.is_main():
                save_file(shared, path / "shared.pt")
        except (OSError, ValueError) as exc:
            error = exc
        _agree(error, f"checkpoint at step {step}: writing {path}")
        if pdist.is_main():
            try:
                write_manifest(path, step=step, world_size=pdist.world_size())
            except OSError as exc:
                error = exc
        _agree(error, f"checkpoint at step {step}: writing {path / MANIFEST}")

    def _prune(self, step: int) -> None:
        """Delete checkpoints beyond `keep`, unfinished older ones and abandoned newer ones
        (left after resuming from an older checkpoint)."""
        steps = self._steps()
        done = [(s, p) for s, p in steps if s <= step and (p / MANIFEST).is_file()]
        drop = {p for _, p in done[: -self.keep]}
        drop |= {p for s, p in steps if s > step or (s < step and not (p / MANIFEST).is_file())}
        for p in drop:
            shutil.rmtree(p, ignore_errors=True)

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Shared state and this rank's local state (None when saved by another world size).

        Raises:
            UnsafeCheckpointError: a file would run code when unpickled.
            CheckpointError: a file cannot be read.
        """
        try:
            saved_world = int(json.loads((path / MANIFEST).read_text())["world_size"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}/{MANIFEST} is unreadable: {exc}") from None
        shared = safe_load(path / "shared.pt")
        local_path = path / f"rank{pdist.rank()}.pt"
        local = None
        if local_path.exists() and saved_world == pdist.world_size():
            local = safe_load(local_path)
        return shared, local


def has_sharded(path: Path) -> bool:
    """Whether the checkpoint at `path` holds sharded (torch.distributed.checkpoint) state."""
    return (path / SHARDED).is_dir()


def load_sharded(path: Path, state: dict[str, Any]) -> None:
    """Collective: fill `state` (this rank's layout) in place from ``path/sharded``."""
    dcp_load_safe(state, path / SHARDED)
