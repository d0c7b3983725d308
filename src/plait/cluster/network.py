"""Network settings of an emulated cluster: tc-style rates, the named settings, delay, loss.

A CPU computes far slower than a GPU, so the rates that make a CPU cluster
communication-bound are far below real link rates. What carries over from the papers is
the *ratio* of communication to computation, so plait names two settings by that ratio
(see ``NAMED_RATES``) instead of by link speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait import units as _units
from plait.units import RATE_UNITS

# Calibrated on a CIFAR ResNet-18 (batch 8, 4 nodes x 1 single-thread process) with
# `plait bench --workload resnet18 --strategies ssgd --nodes 4 --bandwidth RATE`; the
# measurements behind each value are in benchmarks/RESULTS.md (section "Network settings").
#   slow:     S-SGD iteration >= 5x its compute-only time (as 1 GbE to a GPU cluster)
#   fast:     S-SGD iteration <= 1.5x its compute-only time (as 10 GbE / InfiniBand)
#   balanced: S-SGD communication time about equal to its compute time
NAMED_RATES: dict[str, str] = {
    "slow": "100mbit",
    "balanced": "1gbit",
    "fast": "5gbit",
}

#: tc's rate units in bits per second (`plait.units` holds the one table).
_UNITS = RATE_UNITS


def parse_rate(rate: str) -> float:
    """Return a tc-style rate (``100mbit``, ``1gbit``) in bits per second.

    Delegates to `plait.units.parse_rate`, so every command reads rates the same way.

    Raises:
        ValueError: if the rate is not a number followed by a tc unit, or is outside the
            range tc can shape (the message lists the units and the named settings).
    """
    try:
        return _units.parse_rate(rate)
    except ValueError as exc:
        raise ValueError(f"{exc}; or one of {', '.join(NAMED_RATES)}") from None


def parse_duration(text: str) -> float:
    """Return a tc-style delay (``5ms``, ``200us``, ``0.1s``) in seconds."""
    return _units.parse_duration(text, what="latency")


def resolve_bandwidth(bandwidth: str) -> str:
    """Map a named setting (``slow``, ``fast``, ``balanced``) to its tc rate; check others
    and return them as tc reads them (trimmed, lower-case)."""
    key = bandwidth.strip().lower()
    if key in NAMED_RATES:
        return NAMED_RATES[key]
    parse_rate(key)
    return key


@dataclass(frozen=True, kw_only=True)
class NetworkSpec:
    """Egress shaping applied to every node's link.

    Attributes:
        bandwidth: as the user gave it: a named setting, a tc rate, or None (unshaped).
        latency: one-way added delay, tc syntax (``2ms``), or None.
        loss: packet loss in percent, or None.
    """

    bandwidth: str | None = None
    latency: str | None = None
    loss: float | None = None

    def __post_init__(self) -> None:
        # stored as tc reads them, so library callers get what the command line gets
        if self.bandwidth is not None:
            resolve_bandwidth(self.bandwidth)
            object.__setattr__(self, "bandwidth", self.bandwidth.strip().lower())
        if self.latency is not None:
            parse_duration(self.latency)
            object.__setattr__(self, "latency", _units.canonical_duration(self.latency))
        if self.loss is not None and not 0.0 <= self.loss < 100.0:
            raise ValueError(f"invalid loss {self.loss}: expected a percentage in [0, 100)")

    @property
    def rate(self) -> str | None:
        """The tc rate actually configured (named settings resolved)."""
        return None if self.bandwidth is None else resolve_bandwidth(self.bandwidth)

    @property
    def rate_bps(self) -> float | None:
        """The configured rate in bits per second, or None when unshaped."""
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def shaped(self) -> bool:
        return self.bandwidth is not None or self.latency is not None or bool(self.loss)

    def describe(self) -> str:
        parts = []
        if self.bandwidth is not None:
            named = (
                self.bandwidth if self.bandwidth == self.rate else f"{self.bandwidth}={self.rate}"
            )
            parts.append(named)
        if self.latency:
            parts.append(f"delay {self.latency}")
        if self.loss:
            parts.append(f"loss {self.loss}%")
        return ", ".join(parts) if parts else "unshaped"
