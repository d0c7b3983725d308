from __future__ import annotations

import pytest

from plait.cluster.network import (
    NAMED_RATES,
    NetworkSpec,
    parse_duration,
    parse_rate,
    resolve_bandwidth,
)


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("100mbit", 100e6),
        ("1gbit", 1e9),
        ("10gbit", 10e9),
        ("1.5gbit", 1.5e9),
        ("800kbit", 8e5),
        ("125mbps", 1e9),
    ],
)
def test_parse_rate(text: str, bps: float) -> None:
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize("bad", ["", "fast!", "100", "10 parsecs", "-5mbit", "0mbit"])
def test_parse_rate_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="rate"):
        parse_rate(bad)


def test_named_settings_resolve_to_rates() -> None:
    for name, rate in NAMED_RATES.items():
        assert resolve_bandwidth(name) == rate
        assert parse_rate(rate) > 0
    assert (
        parse_rate(NAMED_RATES["slow"])
        < parse_rate(NAMED_RATES["balanced"])
        < parse_rate(NAMED_RATES["fast"])
    )


def test_network_spec_validation() -> None:
    spec = NetworkSpec(bandwidth="slow", latency="2ms", loss=0.5)
    assert spec.rate == NAMED_RATES["slow"]
    assert spec.shaped
    assert "delay 2ms" in spec.describe()
    assert not NetworkSpec().shaped
    with pytest.raises(ValueError, match="latency"):
        NetworkSpec(latency="fast")
    with pytest.raises(ValueError, match="loss"):
        NetworkSpec(loss=150.0)
    with pytest.raises(ValueError, match="rate"):
        NetworkSpec(bandwidth="warp9")
    assert parse_duration("200us") == pytest.approx(2e-4)


def test_network_spec_stores_values_as_tc_reads_them() -> None:
    spec = NetworkSpec(bandwidth=" 1GBit", latency="2MS")
    assert spec.bandwidth == "1gbit"
    assert spec.latency == "2ms"
    assert NetworkSpec(bandwidth="Slow").rate == NAMED_RATES["slow"]
