from __future__ import annotations

import pytest

from plait.specs import parse_spec, split_specs


def testsplit_specs() -> None:
    assert split_specs("ssgd,acpsgd:rank=4,warmup=2,powersgd") == [
        "ssgd",
        "acpsgd:rank=4,warmup=2",
        "powersgd",
    ]
    assert split_specs("a:x=1,y=2;b") == ["a:x=1,y=2", "b"]


def test_parse_spec_types_values_and_refuses_repeats() -> None:
    assert parse_spec("acpsgd:rank=4,warmup=2.5,seed=x,flag=true") == (
        "acpsgd",
        {"rank": 4, "warmup": 2.5, "seed": "x", "flag": True},
    )
    assert parse_spec("ssgd") == ("ssgd", {})
    with pytest.raises(ValueError, match="given twice"):
        parse_spec("acpsgd:rank=4,rank=8")
    with pytest.raises(ValueError, match="expected key=value"):
        parse_spec("acpsgd:rank")
