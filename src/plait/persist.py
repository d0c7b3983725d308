"""Safe, atomic persistence of training state: the mechanism under every checkpoint.

- Plain state: `to_plain` turns what plait keeps (tensors, numbers, strings, containers,
  NumPy arrays, enums) into data that ``torch.load(weights_only=True)`` reads back;
  `from_plain` restores the arrays. `safe_load` loads only such data: a pickle that
  refers to code raises `UnsafeCheckpointError` instead of running it.
- Atomic files: `write_atomic` writes to a temporary name, fsyncs and renames, and
  `fsync_dir` makes the rename durable, so a crash or a full disk leaves the old file or
  the new one, never a mix.
- Manifests: `write_manifest` records the step, the world size, the format version and
  the size and SHA-256 of every file, written last; `read_manifest` verifies them.
- Distributed checkpoints: `dcp_load_safe` checks the metadata torch.distributed.checkpoint
  pickles against the classes it legitimately holds before loading.

The trainer's checkpoint policy (step folders, how many to keep, resume with fallback)
is `plait.train.checkpoint`; `plait.dp` and `plait.parallel` use this module directly.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import io
import json
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: Version of the checkpoint layout (manifest fields, plain-state encoding).
FORMAT_VERSION = 1


MANIFEST = "MANIFEST.json"


SHARDED = "sharded"


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
