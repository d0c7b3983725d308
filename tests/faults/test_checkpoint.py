"""Checkpoints on disk: a partial, truncated or garbled newest checkpoint is skipped for
the previous complete one, a full disk leaves the previous one intact, and nothing read
back can run code."""

from __future__ import annotations

import enum
import errno
import logging
import os
import pickle
import random
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import plait.persist as ckpt_mod
from plait.persist import CheckpointError, UnsafeCheckpointError, write_manifest
from plait.train.checkpoint import Checkpointer, load_sharded

LOGGER = "plait.train.checkpoint"


def _state(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    shared = {"model": {"w": torch.full((64,), float(step))}, "state": {"step": step}}
    local = {"strategy": {"errors": {"w": torch.arange(8.0) * step}}, "rng": {"n": step}}
    return shared, local


def _two_checkpoints(root: Path) -> Checkpointer:
    ck = Checkpointer(root, keep=3)
    for step in (4, 8):
        shared, local = _state(step)
        ck.save(step, shared=shared, local=local)
    return ck


def _resumes_from_4(ck: Checkpointer, caplog: pytest.LogCaptureFixture, why: str) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        path = ck.latest()
    assert path is not None and path.name == "step_00000004"
    shared, local = ck.load(path)
    assert shared["state"]["step"] == 4 and local is not None
    torch.testing.assert_close(local["strategy"]["errors"]["w"], torch.arange(8.0) * 4)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "step_00000008" in warned and why in warned, warned


def test_newest_checkpoint_without_manifest_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a save killed before its manifest: every data file is there, but it never finished
    ck = _two_checkpoints(tmp_path)
    (tmp_path / "step_00000008" / "MANIFEST.json").unlink()
    _resumes_from_4(ck, caplog, "MANIFEST.json")


def test_truncated_newest_checkpoint_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = _two_checkpoints(tmp_path)
    f = tmp_path / "step_00000008" / "shared.pt"
    f.write_bytes(f.read_bytes()[:100])
    _resumes_from_4(ck, caplog, "truncated")


def test_garbled_newest_checkpoint_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = _two_checkpoints(tmp_path)
    f = tmp_path / "step_00000008" / "rank0.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    f.write_bytes(bytes(data))
    _resumes_from_4(ck, caplog, "SHA-256")


def test_unreadable_manifest_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ck = _two_checkpoints(tmp_path)
    (tmp_path / "step_00000008" / "MANIFEST.json").write_text('{"format": 1, "files": ')
    _resumes_from_4(ck, caplog, "unreadable")


def test_disk_full_during_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ck = Checkpointer(tmp_path, keep=1)
    shared, local = _state(4)
    ck.save(4, shared=shared, local=local)
    before = {p.name: p.read_bytes() for p in (tmp_path / "step_00000004").iterdir()}

    def full_disk(fd: int, data: Any) -> None:
        os.write(fd, bytes(memoryview(data)[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt_mod, "_write_all", full_disk)
    shared, local = _state(8)
    with pytest.raises(CheckpointError, match=r"step 8.*disk is full"):
        ck.save(8, shared=shared, local=local)
    monkeypatch.undo()
    # the earlier checkpoint is untouched and still the one to resume from; the failed
    # one left no directory and no temporary file behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]
    after = {p.name: p.read_bytes() for p in (tmp_path / "step_00000004").iterdir()}
    assert after == before
    path = ck.latest()
    assert path is not None and ck.load(path)[0]["state"]["step"] == 4


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (root only), unmounted afterwards."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
        timeout=30,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=30)


def test_really_full_disk_keeps_the_previous_checkpoint(tiny_fs: Path) -> None:
    ck = Checkpointer(tiny_fs / "ck", keep=1)
    shared, local = _state(4)
    ck.save(4, shared=shared, local=local)
    big = {"model": {"w": torch.zeros(200_000)}, "state": {"step": 8}}  # 800 kB > 256 KiB
    with pytest.raises(CheckpointError, match="disk is full"):
        ck.save(8, shared=big, local=local)
    assert sorted(p.name for p in (tiny_fs / "ck").iterdir()) == ["step_00000004"]
    path = ck.latest()
    assert path is not None and ck.load(path)[0]["state"]["step"] == 4


class _Planted:
    """Unpickling this calls `Path.touch` on the marker: a stand-in for any code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def _plant(step_dir: Path, name: str, marker: Path) -> None:
    step_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": _Planted(marker)}, step_dir / name)


def test_crafted_checkpoint_does_not_run_code(tmp_path: Path) -> None:
    marker = tmp_path / f"pwned-{uuid.uuid4().hex}"
    step_dir = tmp_path / "ck" / "step_00000004"
    _plant(step_dir, "shared.pt", marker)
    torch.save({"n": 1}, step_dir / "rank0.pt")
    (step_dir / "COMPLETE").write_text("world_size=1\n")
    write_manifest(step_dir, step=4, world_size=1)  # a matching manifest proves nothing
    ck = Checkpointer(tmp_path / "ck")
    path = ck.latest()
    assert path == step_dir
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*shared\.pt"):
        ck.load(path)
    assert not marker.exists()


def test_crafted_distributed_checkpoint_metadata_does_not_run_code(tmp_path: Path) -> None:
    # torch.distributed.checkpoint unpickles its index without restriction
    marker = tmp_path / f"pwned-{uuid.uuid4().hex}"
    sharded = tmp_path / "step_00000004" / "sharded"
    sharded.mkdir(parents=True)
    (sharded / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*\.metadata"):
        load_sharded(tmp_path / "step_00000004", {"w": torch.zeros(2)})
    assert not marker.exists()


class _Kind(enum.StrEnum):
    A = "a"


def test_plait_state_loads_as_weights_only(tmp_path: Path) -> None:
    # generator states hold NumPy arrays, K-FAC and compressor state enums: saved as plain
    # data, they load with torch.load(weights_only=True) and come back as they were
    rng = {"python": random.getstate(), "numpy": np.random.get_state()}
    local = {"rng": rng, "kind": _Kind.A, "scalar": np.float32(0.5), "t": torch.ones(3)}
    ck = Checkpointer(tmp_path)
    path = ck.save(1, shared={"state": {"step": 1}}, local=local)
    raw = torch.load(path / "rank0.pt", weights_only=True)
    assert raw["kind"] == "a" and raw["scalar"] == 0.5
    _, back = ck.load(path)
    assert back is not None
    np.random.set_state(back["rng"]["numpy"])
    random.setstate(back["rng"]["python"])
    np.testing.assert_array_equal(back["rng"]["numpy"][1], rng["numpy"][1])
    assert back["rng"]["numpy"][1].dtype == np.uint32


def test_unstorable_state_is_refused_at_save(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"state\['obj'\] is a .*_Planted"):
        ck.save(1, shared={}, local={"obj": _Planted(tmp_path / "x")})
    assert ck.latest() is None


def test_a_refused_newest_checkpoint_falls_back_to_the_older_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a crafted newest checkpoint whose manifest matches: only loading it shows the danger
    ck = _two_checkpoints(tmp_path)
    marker = tmp_path / f"pwned-{uuid.uuid4().hex}"
    _plant(tmp_path / "step_00000008", "shared.pt", marker)
    write_manifest(tmp_path / "step_00000008", step=8, world_size=1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        newest = ck.load_newest()
    assert newest is not None
    path, shared, local = newest
    assert path.name == "step_00000004" and shared["state"]["step"] == 4 and local is not None
    assert not marker.exists()
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "step_00000008" in warned and "refused" in warned, warned


def test_every_checkpoint_unreadable_refuses_to_start_from_step_0(tmp_path: Path) -> None:
    """Starting afresh would let the first save delete the checkpoints (keep=2)."""
    ck = _two_checkpoints(tmp_path)
    for step in ("step_00000004", "step_00000008"):
        with (tmp_path / step / "shared.pt").open("r+b") as f:
            f.write(b"garbage!")
    with pytest.raises(CheckpointError, match="refusing to start from step 0"):
        ck.load_newest()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000008"]


def test_unfinished_saves_alone_start_from_step_0(tmp_path: Path) -> None:
    ck = _two_checkpoints(tmp_path)
    for step in ("step_00000004", "step_00000008"):
        (tmp_path / step / "MANIFEST.json").unlink()  # killed before any save finished
    assert ck.load_newest() is None
