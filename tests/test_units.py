"""`plait.units`: one size, rate and delay parser, whose units mean what they say."""

from __future__ import annotations

import pytest

from plait.cli.common import size_arg
from plait.cluster.network import parse_duration as net_duration
from plait.cluster.network import parse_rate as net_rate
from plait.parallel.memory import parse_bytes
from plait.units import canonical_rate, parse_duration, parse_rate, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2GB", 2 * 10**9),
        ("2GiB", 2 * 2**30),
        ("2gib", 2 * 2**30),
        ("2Gi", 2 * 2**30),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("1.5KiB", 1536),
        ("1kb", 1000),
        ("4096", 4096),
        ("4096B", 4096),
        ("1e9", 10**9),
        (" 3 TiB ", 3 * 2**40),
        (7, 7),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("2G", "ambiguous"),  # binary or decimal? refused rather than guessed
        ("2k", "ambiguous"),
        ("lots", "invalid size"),
        ("-1GB", "invalid size"),
        ("0", "> 0"),
        ("2XB", "unknown unit"),
        ("1e999", "exponent"),
        ("99999999TiB", "larger than"),
        ("", "invalid size"),
    ],
)
def test_parse_size_rejects(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_size(text)


def test_zero_size_only_when_allowed() -> None:
    assert parse_size("0", allow_zero=True) == 0


@pytest.mark.parametrize("text", ["2GB", "2GiB", "512MiB", "1.5GB", "100000"])
def test_every_size_flag_reads_sizes_alike(text: str) -> None:
    """`plait sweep --memory-budget` once read 2GB as 2 GiB and refused 2GiB."""
    assert size_arg(text) == parse_bytes(text) == parse_size(text)


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("100mbit", 100e6),
        ("1gbit", 1e9),
        ("1GBit", 1e9),
        ("10gbit", 10e9),
        ("1kibit", 1024.0),
        ("125mbps", 1e9),  # tc: bps is bytes per second
        ("1kbit", 1e3),
        ("1tbit", 1e12),
    ],
)
def test_parse_rate(text: str, bps: float) -> None:
    assert parse_rate(text) == pytest.approx(bps)
    assert net_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("100", "tc unit"),  # bits or bytes? tc and people disagree
        ("1 gbit", "without a space"),
        ("1bit", "between 1kbit and 1tbit"),
        ("2tbit", "between 1kbit and 1tbit"),
        ("99999999999999999999gbit", "between"),
        ("0mbit", "between"),
        ("-5mbit", "tc unit"),
        ("1e3gbit", "tc unit"),
        ("fast!", "tc unit"),
    ],
)
def test_parse_rate_rejects(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_rate(text)


def test_network_rate_errors_name_the_settings() -> None:
    with pytest.raises(ValueError, match="slow, balanced, fast"):
        net_rate("warp9")
    assert canonical_rate(" 1GBit ") == "1gbit"


@pytest.mark.parametrize(
    ("text", "seconds"), [("5ms", 5e-3), ("200us", 2e-4), ("0.1s", 0.1), ("2msec", 2e-3)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["61s", "99999s", "-1ms", "1 ms", "fast", "5"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="latency"):
        net_duration(text)
