"""`plait.persist`: plain state round trips, refusal of code, atomic files, manifests.
(Crash and corruption scenarios of whole checkpoints are in tests/faults.)"""

from __future__ import annotations

import enum
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.persist import (
    CheckpointError,
    UnsafeCheckpointError,
    from_plain,
    read_manifest,
    safe_load,
    save_file,
    to_plain,
    write_atomic,
    write_manifest,
)


class _Mode(enum.Enum):
    FAST = "fast"


def test_plain_state_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(3).bit_generator.state
    w = torch.arange(4.0)
    state: dict[str, object] = {
        "w": w,
        "mode": _Mode.FAST,
        "array": np.arange(6, dtype=np.int16).reshape(2, 3),
        "scalar": np.float32(1.5),
        "nested": [(1, "a"), {"size": torch.Size([2, 3])}],
        "rng": rng,
    }
    save_file(to_plain(state), tmp_path / "s.pt")
    back = safe_load(tmp_path / "s.pt")
    assert torch.equal(back["w"], w) and back["mode"] == "fast"
    np.testing.assert_array_equal(back["array"], state["array"])
    assert back["scalar"] == 1.5 and back["nested"] == [(1, "a"), {"size": (2, 3)}]
    assert back["rng"] == rng  # a generator state restores exactly
    assert from_plain(to_plain([1, "x"])) == [1, "x"]


def test_objects_that_are_not_plain_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"state\['opt'\] is a builtins.object"):
        to_plain({"opt": object()})
    evil = tmp_path / "evil.pt"
    torch.save({"f": pickle.loads}, evil)  # a function: loading it could run code
    with pytest.raises(UnsafeCheckpointError, match="refusing to load"):
        safe_load(evil)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        safe_load(tmp_path / "junk.pt")


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    write_atomic(target, b"old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_manifest_detects_a_changed_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-3"
    ckpt.mkdir()
    (ckpt / "model.pt").write_bytes(b"abc")
    write_manifest(ckpt, step=3, world_size=2)
    manifest = read_manifest(ckpt)
    assert manifest["step"] == 3 and manifest["world_size"] == 2
    (ckpt / "model.pt").write_bytes(b"abd")
    with pytest.raises(CheckpointError, match=r"model\.pt"):
        read_manifest(ckpt)
    with pytest.raises(CheckpointError, match=r"has no MANIFEST\.json"):
        read_manifest(tmp_path)
