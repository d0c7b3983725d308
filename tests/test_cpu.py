from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from plait import cpu
from plait.cpu import CpuSampler, read_jiffies


def test_busy_reads_the_window_between_samples() -> None:
    s = CpuSampler()
    # (time, busy, idle): 30 busy of 40 jiffies between t=1 and t=3, all idle after
    s.samples = [(0.0, 0, 0), (1.0, 10, 10), (2.0, 25, 15), (3.0, 40, 20), (4.0, 40, 40)]
    assert s.busy(0.5, 3.5) == pytest.approx(30 / 40)
    assert s.busy(2.5, 4.0) == pytest.approx(0.0)
    assert s.busy(1.2, 1.8) is None  # no two samples inside: no figure rather than a guess
    with pytest.raises(ValueError, match="period_s"):
        CpuSampler(period_s=0)


def test_a_spinning_thread_shows_as_busy() -> None:
    if read_jiffies() is None:
        pytest.skip("no /proc/stat")
    with CpuSampler(period_s=0.05) as s:
        start = time.time()
        while time.time() - start < 0.6:  # one core of the host busy
            pass
        end = time.time()
    busy = s.busy(start, end)
    # one of the host's cores was busy the whole window (0.9: samples straddle its edges)
    assert busy is not None and busy >= 0.9 / (os.cpu_count() or 1)
    assert len(s.samples) >= 5


def test_without_proc_stat_nothing_is_sampled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cpu, "_STAT", tmp_path / "missing")
    assert read_jiffies() is None
    with CpuSampler(period_s=0.01) as s:
        time.sleep(0.05)
    assert s.samples == [] and s.busy(0.0, time.time()) is None


def test_float_pins_need_avx2_and_fma(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu, "_CPUINFO", info)
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n")
    assert cpu.cpu_flags() >= {"avx2", "fma"}
    assert cpu.float_pins() == cpu.AVX2_PINS
    assert cpu.float_pins() is not cpu.AVX2_PINS  # a copy: callers may add to it
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx\n")
    assert cpu.float_pins() == {}
    info.unlink()
    assert cpu.cpu_flags() == set() and cpu.float_pins() == {}
