"""Hyper-parameter checks: constants at once, schedules each time they are read."""

from __future__ import annotations

import pytest

from plait.kfac.checks import check_value
from plait.kfac.config import KFACConfig


def test_callable_schedules_are_checked_when_evaluated() -> None:
    cfg = KFACConfig(damping=lambda s: 0.1 / (s + 1), inv_interval=lambda s: 1 + s // 10)
    assert check_value("damping", cfg.damping, 9, low=0.0, low_open=True) == pytest.approx(0.01)
    assert check_value("inv_interval", cfg.inv_interval, 25) == 3
    with pytest.raises(ValueError, match="damping"):
        check_value("damping", lambda s: -1.0, 0, low=0.0, low_open=True)
    with pytest.raises(ValueError, match="inv_interval"):
        check_value("inv_interval", lambda s: 0, 0)
