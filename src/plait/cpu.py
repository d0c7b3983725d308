"""How busy the host's CPUs were over a window of wall-clock time, and which kernels its
floating-point libraries dispatch to.

Co-location can only turn idle CPU time into progress: when the cores are already busy
with one arrangement of jobs, another can gain at most the idle share (unless it also
does less work per step). `CpuSampler` records the host's cumulative busy and idle time
(``/proc/stat``, all CPUs) in the background, and `busy` reads the fraction busy between
two wall-clock instants, e.g. the window in which co-located jobs are measured.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from pathlib import Path

_STAT = Path("/proc/stat")
_CPUINFO = Path("/proc/cpuinfo")
logger = logging.getLogger(__name__)

#: The environment that pins torch's CPU kernels to their AVX2 code paths: ATen's
#: vectorised kernels, MKL's BLAS (conditional numerical reproducibility, strict) and
#: oneDNN's convolutions. Each library otherwise picks the widest instructions the CPU
#: has (AVX-512 on some hosts of a kind, AVX2 on others), and kernels of different width
#: sum in different orders: the same run then drifts apart by rounding within a few steps
#: (measured in benchmarks/race/float-dispatch). Pinned, every host with AVX2 and FMA runs
#: the same instructions; with one thread per worker (`plait race` runs its workers so)
#: the sums' order no longer depends on the host.
AVX2_PINS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``), empty where unreadable."""
    try:
        for line in _CPUINFO.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def float_pins() -> dict[str, str]:
    """`AVX2_PINS` where the CPU has AVX2 and FMA, else nothing (with a warning: results
    then depend on this host's kernels)."""
    if {"avx2", "fma"} <= cpu_flags():
        return dict(AVX2_PINS)
    logger.warning("this CPU lacks AVX2/FMA: its floating-point kernels are not pinned")
    return {}


def read_jiffies() -> tuple[int, int] | None:
    """Cumulative (busy, idle) jiffies of all CPUs; None where ``/proc/stat`` is missing.

    Idle counts idle and iowait; busy counts everything else (user, nice, system, irq,
    softirq, steal): the kernel's network path, which the emulated links run through, is
    busy time too.
    """
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    values = [int(v) for v in fields[1:9]]
    idle = values[3] + values[4]
    return sum(values) - idle, idle


class CpuSampler:
    """Samples `read_jiffies` every `period_s` on a daemon thread while entered.

    Args:
        period_s: sampling period; `busy` resolves windows to about this precision.
    """

    def __init__(self, *, period_s: float = 0.25) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.period_s = period_s
        self.samples: list[tuple[float, int, int]] = []  # (unix time, busy, idle)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        j = read_jiffies()
        if j is not None:
            self.samples.append((time.time(), *j))

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def __enter__(self) -> CpuSampler:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def busy(self, start: float, end: float) -> float | None:
        """Fraction of CPU time busy between the samples nearest inside [start, end]; None
        when fewer than two samples fall inside."""
        times = [s[0] for s in self.samples]
        lo = bisect.bisect_left(times, start)
        hi = bisect.bisect_right(times, end) - 1
        if hi - lo < 1:
            return None
        _, b0, i0 = self.samples[lo]
        _, b1, i1 = self.samples[hi]
        total = (b1 - b0) + (i1 - i0)
        return (b1 - b0) / total if total > 0 else None
