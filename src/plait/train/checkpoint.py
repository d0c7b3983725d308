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

Nothing read back can run code: files are loaded with ``torch.load(weights_only=True)``
and plait stores only tensors, numbers, strings and containers (`to_plain` turns NumPy
arrays and enums into those before saving, `from_plain` restores the arrays). The
metadata that torch.distributed.checkpoint pickles is checked against the classes it
legitimately holds before it is unpickled, and its non-tensor values load with
``weights_only=True`` as well. Checkpoints are written and read on a file system that
all ranks share (the emulated cluster's nodes share the host's).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from plait import distributed as pdist

logger = logging.getLogger(__name__)

#: Version of the checkpoint layout (manifest fields, plain-state encoding).
FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
SHARDED = "sharded"
_STEP_RE = re.compile(r"^step_(\d{8})$")
_NDARRAY = "__plait_ndarray__"
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or could not be trusted when read."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds objects whose loading could run code; it was not loaded."""


# ----------------------------------------------------------------- plain state
def to_plain(obj: Any, where: str = "state") -> Any:
    """`obj` as tensors, numbers, strings, bytes, None and dicts/lists/tuples only.

    Such state loads with ``torch.load(weights_only=True)``, which refuses anything that
    could run code. NumPy arrays (random generator states) become tagged byte strings that
    `from_plain` turns back into arrays; NumPy scalars become Python numbers; enums become
    their values (plait's loaders parse them back, e.g. ``Method(state["method"])``).

    Raises:
        ValueError: an object of another type, named by its path in `obj`.
    """
    if obj is None or isinstance(obj, bool | int | float | str | bytes | torch.dtype):
        if isinstance(obj, enum.Enum):
            return to_plain(obj.value, where)
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value, where)
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return {_NDARRAY: arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.Size):
        return tuple(obj)
    if isinstance(obj, dict):
        return {to_plain(k, where): to_plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise ValueError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint "
        "cannot hold: store tensors, numbers, strings and containers of them"
    )


def from_plain(obj: Any) -> Any:
    """Undo `to_plain`'s encoding of NumPy arrays (everything else is returned as is)."""
    if isinstance(obj, dict):
        if _NDARRAY in obj:
            dtype = np.dtype(obj[_NDARRAY])
            if dtype.hasobject:
                raise UnsafeCheckpointError("checkpoint holds a NumPy array of Python objects")
            shape = tuple(int(d) for d in obj["shape"])
            return np.frombuffer(obj["data"], dtype=dtype).reshape(shape).copy()
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain(v) for v in obj)
    return obj


def safe_load(path: Path) -> Any:
    """Load a file written by `save_file`: plain data only, never code.

    Raises:
        UnsafeCheckpointError: the file's pickle refers to classes or functions outside
            torch's weights-only allowlist (a crafted or foreign checkpoint).
        CheckpointError: the file is not a readable torch checkpoint.
    """
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeCheckpointError(
            f"refusing to load {path}: it holds objects that are not plain tensors and "
            f"containers, and loading them could run code ({first})"
        ) from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return from_plain(obj)


# ------------------------------------------------------------------ writing
def _write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of `data` to `fd` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: Path) -> None:
    """Make the renames and unlinks in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` holds either its old content or all of it.

    The bytes go to a temporary file in the same directory, are fsynced, and the file is
    renamed over `path`; on failure the temporary file is removed and `path` untouched.
    The caller fsyncs the directory once all its renames are done.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def save_file(obj: Any, path: Path) -> None:
    """`torch.save` plain state (see `to_plain`) atomically to `path`."""
    buf = io.BytesIO()
    torch.save(to_plain(obj), buf)
    write_atomic(path, buf.getvalue())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files_of(path: Path) -> Iterable[Path]:
    for p in sorted(path.rglob("*")):
        # temporary files start with a dot; torch.distributed.checkpoint's index does too
        hidden = p.name.startswith(".") and p.name != ".metadata"
        if p.is_file() and p.name != MANIFEST and not hidden:
            yield p


def write_manifest(path: Path, *, step: int, world_size: int) -> None:
    """Record every file of checkpoint `path` (size, SHA-256); written last, atomically."""
    files = {
        p.relative_to(path).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files_of(path)
    }
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "files": files,
    }
    for sub in {path} | {(path / f).parent for f in files}:
        fsync_dir(sub)
    write_atomic(path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    fsync_dir(path)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint `path`, after checking every file against it.

    Raises:
        CheckpointError: no manifest, an unreadable one, or a file missing, of another
            size or with another checksum; the message says which.
    """
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path.name} has no {MANIFEST} (its save did not finish)")
    try:
        manifest = json.loads(mpath.read_text())
        version = manifest["format"]
        files = manifest["files"]
        int(manifest["step"]), int(manifest["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path.name}/{MANIFEST} is unreadable: {exc}") from None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path.name} is in checkpoint format {version}, this version reads {FORMAT_VERSION}"
        )
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{path.name}/{MANIFEST} lists no files")
    root = path.resolve()
    for rel, want in files.items():
        f = (path / rel).resolve()
        if not f.is_relative_to(root) or f == root:
            raise CheckpointError(f"{path.name}/{MANIFEST} names a file outside it: {rel!r}")
        if not f.is_file():
            raise CheckpointError(f"{path.name}/{rel} is missing")
        size = f.stat().st_size
        if size != want.get("size"):
            raise CheckpointError(
                f"{path.name}/{rel} has {size} bytes, the manifest says {want.get('size')} "
                "(truncated or rewritten)"
            )
        if _sha256(f) != want.get("sha256"):
            raise CheckpointError(f"{path.name}/{rel} does not match its SHA-256 (corrupted)")
    return manifest  # type: ignore[no-any-return]


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
        gathered: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
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
        for step, path in reversed(self._steps()):
            try:
                manifest = read_manifest(path)
                if int(manifest["step"]) != step:
                    raise CheckpointError(f"{path.name}'s manifest is for step {manifest['step']}")
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %s: %s; trying an older one", path, exc)
                continue
            return path
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
        dist.broadcast_object_list(choice, src=0)
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
        pdist.barrier()
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


# ----------------------------------------------- torch.distributed.checkpoint
#: Classes a torch.distributed.checkpoint ``.metadata`` pickle legitimately refers to.
_DCP_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed")


def check_dcp_metadata(path: Path) -> None:
    """Refuse a torch.distributed.checkpoint directory whose ``.metadata`` could run code.

    torch unpickles that file with no restriction; this reads it first with only the
    metadata classes allowed.

    Raises:
        UnsafeCheckpointError: the metadata refers to anything else.
        CheckpointError: no readable metadata.
    """
    meta = path / ".metadata"
    try:
        with meta.open("rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"refusing to load {path}: its .metadata refers to code ({exc})"
        ) from None
    except (OSError, EOFError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"cannot read {meta}: {exc}") from exc


def dcp_load_safe(state: dict[str, Any], path: Path) -> None:
    """Collective: `torch.distributed.checkpoint` load of `path` into `state`, in place,
    after `check_dcp_metadata`, with non-tensor values loaded as weights only."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    class _WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    check_dcp_metadata(path)
    try:
        dcp_load(state, checkpoint_id=str(path), planner=_WeightsOnlyPlanner())
    except Exception as exc:
        # torch wraps a rank's error in a CheckpointException; a refused pickle says so
        if (
            isinstance(exc, pickle.UnpicklingError)
            or "weights only load failed" in str(exc).lower()
        ):
            raise UnsafeCheckpointError(
                f"refusing to load {path}: a value in it is not plain data ({exc})"
            ) from None
        raise


def has_sharded(path: Path) -> bool:
    """Whether the checkpoint at `path` holds sharded (torch.distributed.checkpoint) state."""
    return (path / SHARDED).is_dir()


def load_sharded(path: Path, state: dict[str, Any]) -> None:
    """Collective: fill `state` (this rank's layout) in place from ``path/sharded``."""
    dcp_load_safe(state, path / SHARDED)
