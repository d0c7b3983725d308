"""`LocalConfig` and `local_config`: every bad value is refused where it is written."""

from __future__ import annotations

import pytest

from plait.dp.local import Codec, LocalConfig, OuterOptimizer, local_config


def test_defaults_are_diloco_and_localsgd_averages() -> None:
    d = local_config("diloco")
    assert (d.outer_optimizer, d.outer_lr, d.outer_momentum) == (OuterOptimizer.NESTEROV, 0.7, 0.9)
    s = local_config("localsgd", inner_steps=4)
    assert (s.outer_optimizer, s.outer_lr, s.outer_momentum) == (OuterOptimizer.SGD, 1.0, 0.0)
    assert s.inner_steps == 4


def test_text_values_become_enums() -> None:
    c = LocalConfig(compression="int4", outer_optimizer="adam")  # type: ignore[arg-type]
    assert c.compression is Codec.INT4 and c.outer_optimizer is OuterOptimizer.ADAM
    assert c.describe() == "H=50, int4"
    assert LocalConfig(inner_steps=8, fragments=4, delay=1).describe() == "H=8, F=4, tau=1"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"inner_steps": 0}, "inner_steps must be an integer >= 1"),
        ({"inner_steps": 2.5}, "inner_steps must be an integer"),
        ({"inner_steps": True}, "inner_steps must be an integer"),
        ({"fragments": 0}, "fragments must be an integer >= 1"),
        ({"inner_steps": 4, "fragments": 5}, "fragments (5) must be <= inner_steps (4)"),
        ({"inner_steps": 4, "delay": 4}, "delay (4) must be below inner_steps (4)"),
        ({"delay": -1}, "delay must be an integer >= 0"),
        ({"outer_lr": 0}, "outer_lr must be a number in (0"),
        ({"outer_lr": float("nan")}, "outer_lr must be a number"),
        ({"outer_momentum": 1.0}, "outer_momentum must be < 1"),
        ({"outer_momentum": -0.1}, "outer_momentum must be a number in [0"),
        ({"mix": 1.5}, "mix must be a number in [0, 1]"),
        ({"ratio": 0}, "ratio must be a number in (0, 1]"),
        ({"rank": 0}, "rank must be an integer >= 1"),
        ({"block": 1}, "block must be an integer >= 2"),
        ({"compression": "int3"}, "compression must be one of none, fp16, bf16, int8, int4"),
        ({"outer_optimizer": "lion"}, "outer_optimizer must be one of nesterov, sgd, adam"),
        ({"error_feedback": "yes"}, "error_feedback must be true or false"),
        ({"timeout_s": 0}, "timeout_s must be a number in (0"),
    ],
)
def test_bad_values_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        LocalConfig(**options)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_unknown_method_or_option_lists_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="unknown local-update method 'fedavg'"):
        local_config("fedavg")
    with pytest.raises(ValueError, match=r"unknown option 'inner_stps' .*accepted: inner_steps"):
        local_config("diloco", inner_stps=3)
