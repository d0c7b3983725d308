"""Fragments of a model and the stagger on which they synchronise (Streaming DiLoCo).

Pure functions of parameter names and step numbers, so the schedule tests without
processes and is identical on every rank by construction.

A *unit* is a block of a layer stack (``blocks.3.*``: the path up to its first numeric
component) or, for parameters outside any stack, the module that holds them. Units are
dealt out to fragments strided (fragment f holds units f, f + F, f + 2F, ...), as
Streaming DiLoCo does: every fragment then spans the depth of the network, which its
authors found slightly more stable than contiguous blocks of layers.
"""

from __future__ import annotations

from collections.abc import Sequence


def unit_of(name: str) -> str:
    """The unit a parameter (or buffer) belongs to: ``blocks.3.attn.qkv.weight`` ->
    ``blocks.3``; ``head.weight`` -> ``head``; ``bias`` -> ``""``."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1])


def units(names: Sequence[str]) -> list[str]:
    """The distinct units of `names`, in the order they first appear."""
    return list(dict.fromkeys(unit_of(n) for n in names))


def split(names: Sequence[str], fragments: int) -> list[list[int]]:
    """Indices of `names` per fragment, units dealt out strided.

    Raises:
        ValueError: fewer units than fragments (the message says how many there are).
    """
    order = units(names)
    if fragments > len(order):
        raise ValueError(
            f"the model has {len(order)} unit(s) to synchronise separately (blocks of a layer "
            f"stack, or modules outside one), fewer than fragments={fragments}"
        )
    slot = {u: i % fragments for i, u in enumerate(order)}
    out: list[list[int]] = [[] for _ in range(fragments)]
    for i, n in enumerate(names):
        out[slot[unit_of(n)]].append(i)
    return out


def offset(fragment: int, fragments: int, inner_steps: int) -> int:
    """The inner step (mod H) after which `fragment` starts its exchange.

    Fragment f syncs after steps t with t % H == ((f + 1) * H // F) % H: one fragment
    every H / F steps, the last on the round's last step, so F = 1 is plain DiLoCo.
    """
    return ((fragment + 1) * inner_steps // fragments) % inner_steps


def starts(step: int, fragments: int, inner_steps: int) -> list[int]:
    """The fragments whose exchange starts after inner step `step` (counted from 1)."""
    return [f for f in range(fragments) if step % inner_steps == offset(f, fragments, inner_steps)]
