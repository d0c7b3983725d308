"""The checkpoint policy at world 1: what is kept, which checkpoint resumes, what is cleaned
up. (Damaged files, full disks and crafted pickles: tests/faults/test_checkpoint.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.persist import MANIFEST
from plait.train.checkpoint import Checkpointer, has_sharded


def _save(ck: Checkpointer, step: int) -> Path:
    return ck.save(
        step,
        shared={"model": {"w": torch.full((4,), float(step))}, "step": step},
        local={"rng": {"n": step}},
    )


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        Checkpointer(tmp_path, keep=0)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ckpt")  # created on the first save
    assert ck.latest() is None and ck.complete() == []
    path = _save(ck, 7)
    assert path == tmp_path / "ckpt" / "step_00000007"
    assert {p.name for p in path.iterdir()} == {"shared.pt", "rank0.pt", MANIFEST}
    assert ck.latest() == path and not has_sharded(path)
    shared, local = ck.load(path)
    torch.testing.assert_close(shared["model"]["w"], torch.full((4,), 7.0))
    assert shared["step"] == 7 and local == {"rng": {"n": 7}}


def test_only_the_newest_keep_are_kept(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3, 10):
        _save(ck, step)
    assert _steps(tmp_path) == ["step_00000003", "step_00000010"]
    assert [s for s, _ in ck.complete()] == [3, 10]
    assert ck.latest() == tmp_path / "step_00000010"  # by step, not by name length or time


def test_latest_falls_back_past_a_manifest_of_another_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ck = Checkpointer(tmp_path, keep=3)
    _save(ck, 4)
    newest = _save(ck, 8)
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["step"] = 9  # e.g. a directory renamed by hand
    (newest / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="plait.train.checkpoint"):
        assert ck.latest() == tmp_path / "step_00000004"
    assert "manifest is for step 9" in caplog.text and "step_00000008" in caplog.text


def test_save_cleans_up_unfinished_and_abandoned_checkpoints(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, keep=5)
    for step in (2, 4, 6):
        _save(ck, step)
    (tmp_path / "step_00000004" / MANIFEST).unlink()  # a save of 4 that never finished
    (tmp_path / "step_00000003").mkdir()  # an older save killed before its manifest
    assert ck.latest() == tmp_path / "step_00000006"
    # resumed from step 2 (say 6 was from another run), the run saves step 5 next: 6 is
    # an abandoned future and goes, as do the unfinished 3 and 4
    _save(ck, 5)
    assert _steps(tmp_path) == ["step_00000002", "step_00000005"]


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path)
    _save(ck, 3)
    path = ck.save(3, shared={"step": 30}, local={})
    assert ck.load(path)[0] == {"step": 30}
    assert _steps(tmp_path) == ["step_00000003"]


def test_other_entries_in_the_folder_are_left_alone(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path, keep=1)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step_1").mkdir()  # not the checkpoint naming scheme
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "step_00000099").symlink_to(tmp_path / "elsewhere")
    _save(ck, 1)
    _save(ck, 2)
    assert _steps(tmp_path) == [
        "elsewhere",
        "notes.txt",
        "step_00000002",
        "step_00000099",
        "step_1",
    ]
    assert ck.latest() == tmp_path / "step_00000002"  # a link is never taken for a checkpoint


def test_local_state_of_another_world_size_is_not_loaded(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path)
    path = _save(ck, 1)
    manifest: dict[str, Any] = json.loads((path / MANIFEST).read_text())
    assert manifest["world_size"] == 1
    manifest["world_size"] = 2  # saved by two ranks: rank0.pt is not this rank's state
    (path / MANIFEST).write_text(json.dumps(manifest))
    shared, local = ck.load(path)
    assert shared["step"] == 1 and local is None
