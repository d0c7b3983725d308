"""Fragments and their stagger: pure functions of names and step numbers."""

from __future__ import annotations

import itertools

import pytest

from plait.dp.local import fragments as frag

GPT = [
    "wte.weight",
    "blocks.0.attn.qkv.weight",
    "blocks.0.attn.qkv.bias",
    "blocks.0.mlp.fc.weight",
    "blocks.1.attn.qkv.weight",
    "blocks.1.mlp.fc.weight",
    "blocks.2.attn.qkv.weight",
    "blocks.3.attn.qkv.weight",
    "ln_f.weight",
    "head.weight",
]


def test_units_are_blocks_of_a_stack_or_modules() -> None:
    assert frag.unit_of("blocks.3.attn.qkv.weight") == "blocks.3"
    assert frag.unit_of("transformer.h.11.mlp.c_fc.weight") == "transformer.h.11"
    assert frag.unit_of("head.weight") == "head"
    assert frag.unit_of("bias") == ""
    assert frag.units(GPT) == [
        "wte",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "ln_f",
        "head",
    ]


def test_units_are_dealt_out_strided() -> None:
    parts = frag.split(GPT, 2)
    names = [[GPT[i] for i in idx] for idx in parts]
    # units 0, 2, 4, 6 (wte, blocks.1, blocks.3, head) and 1, 3, 5 (blocks.0, blocks.2, ln_f)
    assert names[0] == [
        "wte.weight",
        "blocks.1.attn.qkv.weight",
        "blocks.1.mlp.fc.weight",
        "blocks.3.attn.qkv.weight",
        "head.weight",
    ]
    assert names[1] == [
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.qkv.bias",
        "blocks.0.mlp.fc.weight",
        "blocks.2.attn.qkv.weight",
        "ln_f.weight",
    ]
    assert sorted(i for p in frag.split(GPT, 3) for i in p) == list(range(len(GPT)))
    assert frag.split(GPT, 1) == [list(range(len(GPT)))]


def test_more_fragments_than_units_is_refused() -> None:
    with pytest.raises(ValueError, match="has 7 unit"):
        frag.split(GPT, 8)


@pytest.mark.parametrize(("fragments", "h"), [(1, 1), (1, 5), (2, 10), (3, 10), (4, 4), (5, 12)])
def test_every_fragment_starts_once_per_round_on_a_stagger(fragments: int, h: int) -> None:
    rounds = 3
    starts = {f: [] for f in range(fragments)}  # type: dict[int, list[int]]
    for step in range(1, rounds * h + 1):
        for f in frag.starts(step, fragments, h):
            starts[f].append(step)
    for f, steps in starts.items():
        assert len(steps) == rounds, (f, steps)
        assert all(b - a == h for a, b in itertools.pairwise(steps)), steps
    # one fragment every H / F steps, the last on the round's last step
    firsts = sorted(s[0] for s in starts.values())
    assert firsts[-1] == h
    assert len(set(firsts)) == fragments


def test_plain_diloco_synchronises_at_the_end_of_each_round() -> None:
    assert [t for t in range(1, 31) if frag.starts(t, 1, 10)] == [10, 20, 30]
    assert frag.offset(0, 2, 10) == 5 and frag.offset(1, 2, 10) == 0
