"""The compute token trusts nothing it finds on disk: links, strangers' files, held locks."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest

from plait.crossover import token
from plait.crossover.token import ComputeToken, TokenTimeoutError


def _victim(folder: Path, name: str) -> Path:
    folder.mkdir(mode=0o700, exist_ok=True)
    victim = folder / name
    victim.write_bytes(b"precious\n")
    return victim


def test_symlinked_token_directory_is_refused_and_its_target_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another user creates /tmp/plait-crossover-<uid> first, as a link to a directory that
    # passes every check a followed link would see (ours, 0700).
    root, target = tmp_path / "root", tmp_path / "target"
    root.mkdir()
    victim = _victim(target, "g.dev.token")
    (root / f"plait-crossover-{os.getuid()}").symlink_to(target)
    monkeypatch.setenv("PLAIT_TOKEN_DIR", str(root))
    with pytest.raises(PermissionError, match="symbolic link"):
        ComputeToken("g", key="dev")
    assert victim.read_bytes() == b"precious\n"
    assert sorted(p.name for p in target.iterdir()) == ["g.dev.token"]


def test_symlinked_token_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "tokens"
    folder.mkdir(mode=0o700)
    victim = _victim(tmp_path / "elsewhere", "file")
    (folder / "g.dev.token").symlink_to(victim)
    with pytest.raises(PermissionError, match="symbolic link"):
        ComputeToken("g", key="dev", directory=folder)
    assert victim.read_bytes() == b"precious\n"


def test_a_file_that_is_not_a_token_is_refused_at_once(tmp_path: Path) -> None:
    # Garbage counters used to be mapped as they were and waited on until the timeout (or
    # for ever, with a hand-off time in the future).
    (tmp_path / "g.dev.token").write_bytes(b"\x7f" * 4096)
    start = time.monotonic()
    with pytest.raises(ValueError, match="not a plait compute token"):
        ComputeToken("g", key="dev", directory=tmp_path, timeout_s=300)
    assert time.monotonic() - start < 5


def test_group_or_world_accessible_directory_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "tokens"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match="0700"):
        ComputeToken("g", key="dev", directory=folder)
    assert not list(folder.iterdir())


def test_a_stuck_file_lock_ends_in_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ComputeToken("g", key="dev", directory=tmp_path).close()
    monkeypatch.setattr(token, "LOCK_TIMEOUT_S", 0.3)
    fd = os.open(tmp_path / "g.dev.token", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a process stuck inside its few locked writes
        start = time.monotonic()
        with pytest.raises(TokenTimeoutError, match="file lock"):
            ComputeToken("g", key="dev", directory=tmp_path, timeout_s=300)
        assert time.monotonic() - start < 5
    finally:
        os.close(fd)
    tok = ComputeToken("g", key="dev", directory=tmp_path)
    with tok:
        assert tok.held
    tok.close()
