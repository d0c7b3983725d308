"""glibc tuning for fused arrays: thresholds set through mallopt, False without glibc."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from plait.fused import malloc


class FakeLibc:
    """Records mallopt calls instead of changing this test process's allocator."""

    def __init__(self, answer: int) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


def test_raises_both_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = FakeLibc(answer=1)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libc.so.6")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    assert malloc.tune_malloc(trim_threshold=1 << 20, mmap_threshold=1 << 16)
    assert libc.calls == [(malloc.M_TRIM_THRESHOLD, 1 << 20), (malloc.M_MMAP_THRESHOLD, 1 << 16)]


def test_false_when_mallopt_refuses_or_there_is_no_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libc.so.6")
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FakeLibc(answer=0))
    assert not malloc.tune_malloc()

    def no_library(name: str) -> object:
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert not malloc.tune_malloc()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert not malloc.tune_malloc()
