"""The native kernel cache loads nothing that someone else could have written."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait.fused import native
from plait.fused.native import build

REASON = native.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernels: {REASON}")
SIZES = {"SEQ": 4, "HEAD": 2}
PLANTED = r"""
#include <fcntl.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    int fd = open(MARKER, O_CREAT | O_WRONLY, 0644);
    if (fd >= 0) close(fd);
}
"""


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """$PLAIT_CACHE_DIR (not created), with no library loaded and the warning not yet given."""
    root = tmp_path / "cache"
    monkeypatch.setenv(build.ENV_CACHE, str(root))
    saved = dict(build._libraries)
    build._libraries.clear()
    monkeypatch.setitem(build._state, "warned", False)
    monkeypatch.setattr(build, "_refused", set())
    yield root
    build._libraries.clear()
    build._libraries.update(saved)


def planted_library(tmp_path: Path) -> tuple[Path, Path]:
    """A shared library whose constructor creates a marker file; (library, marker)."""
    src, lib, marker = tmp_path / "planted.c", tmp_path / "planted.so", tmp_path / "MARKER"
    src.write_text(PLANTED)
    cc = build.compiler()
    assert cc is not None
    subprocess.run(
        [cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(lib)],
        check=True,
        timeout=60,
    )
    return lib, marker


def plant(folder: Path, lib: Path) -> Path:
    """Put `lib` where the cache keeps the SEQ=4, HEAD=2 kernels, with a matching digest
    file: the key is computable by anyone, and so is a digest."""
    target = build.library_path(SIZES, folder)
    data = lib.read_bytes()
    target.write_bytes(data)
    target.chmod(0o755)
    key = target.name.removeprefix("kernels-").removesuffix(".so")
    Path(f"{target}.sha256").write_text(f"{hashlib.sha256(data).hexdigest()} {key}\n")
    return target


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cache refused" in r.getMessage()]


def test_planted_library_in_a_world_writable_cache_is_never_loaded(
    cache_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lib, marker = planted_library(tmp_path)
    folder = cache_root / "native"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    planted = plant(folder, lib)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load(**SIZES) is not None  # built and loaded elsewhere
        assert build.load(SEQ=4, HEAD=3) is not None  # warned once, not once per size
    assert not marker.exists()
    assert planted.read_bytes() == lib.read_bytes()  # refused, not touched
    [message] = refusals(caplog)
    assert "writable by others" in message and "0o777" in message


def test_cache_under_a_parent_others_can_write_is_refused(
    cache_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache_root.mkdir()
    cache_root.chmod(0o777)  # not sticky: anyone may rename `native` and put theirs there
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load(**SIZES) is not None
    [message] = refusals(caplog)
    assert "parent" in message
    assert not list((cache_root / "native").glob("kernels-*"))


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_cache_owned_by_another_user_is_refused(
    cache_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    lib, marker = planted_library(tmp_path)
    folder = cache_root / "native"
    folder.mkdir(parents=True, mode=0o700)
    plant(folder, lib)
    for path in (folder, *folder.iterdir()):
        os.chown(path, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load(**SIZES) is not None
    assert not marker.exists()
    [message] = refusals(caplog)
    assert "uid 65534" in message


def test_tampered_library_in_a_private_cache_is_rebuilt_not_loaded(
    cache_root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert build.load(**SIZES) is not None
    folder = cache_root / "native"
    path = build.library_path(SIZES, folder)
    good = path.read_bytes()
    lib, marker = planted_library(tmp_path)
    # Same name, owner and mode, other bytes (a new file: the old one is mapped in here).
    tampered = path.with_name("tampered")
    tampered.write_bytes(lib.read_bytes())
    tampered.chmod(0o700)
    os.replace(tampered, path)
    build._libraries.clear()
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load(**SIZES) is not None
    assert not marker.exists()
    assert any("rebuilding" in r.getMessage() for r in caplog.records)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(good).digest()
    assert not refusals(caplog)


def test_cache_is_created_private_and_a_loose_one_of_ours_tightened(cache_root: Path) -> None:
    assert build.load(**SIZES) is not None
    folder = cache_root / "native"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert cache_root.stat().st_mode & 0o777 == 0o700
    folder.chmod(0o755)  # made by an older plait with default permissions
    build._libraries.clear()
    assert build.load(**SIZES) is not None
    assert folder.stat().st_mode & 0o777 == 0o700
