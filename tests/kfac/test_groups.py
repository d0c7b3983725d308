"""`ProcessGroups`: the sub-groups placement needs, made alike on every rank, no process."""

from __future__ import annotations

import pytest

from plait.kfac.groups import ProcessGroups


def _recorder() -> tuple[list[list[int]], object]:
    made: list[list[int]] = []

    def factory(ranks: list[int]) -> str:
        made.append(list(ranks))
        return f"group{ranks}"

    return made, factory


def test_blocks_and_receivers_are_made_once_in_a_fixed_order() -> None:
    made, factory = _recorder()
    groups = ProcessGroups(4, 1, factory=factory)  # type: ignore[arg-type]
    assert made == [[0, 1, 2, 3]] and groups.group == "group[0, 1, 2, 3]"
    groups.ensure(2)  # hybrid blocks of two: blocks, then ranks at the same position
    assert made[1:] == [[0, 1], [2, 3], [0, 2], [1, 3]]
    groups.ensure(2)
    groups.ensure(4)  # comm-opt: the whole group only
    groups.ensure(1)  # mem-opt: every rank receives from every other: the whole group
    assert len(made) == 5
    assert groups.get((2, 3)) == "group[2, 3]" and groups.made[0] == (0, 1, 2, 3)


def test_a_subgroup_of_the_job_names_global_ranks() -> None:
    made, factory = _recorder()
    groups = ProcessGroups(2, 0, ranks=[4, 6], factory=factory)  # type: ignore[arg-type]
    groups.ensure(1)
    assert made == [[4, 6]] and groups.global_rank(1) == 6


def test_one_process_makes_no_group() -> None:
    made, factory = _recorder()
    groups = ProcessGroups(factory=factory)  # type: ignore[arg-type]
    groups.ensure(1)
    assert made == [] and groups.group is None and groups.world == 1
    assert ProcessGroups.of().world == 1  # torch.distributed is not initialised here


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"world": 2, "rank": 2}, "rank 2"), ({"world": 2, "ranks": [0]}, "1 global")],
)
def test_bad_groups_are_value_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ProcessGroups(**kwargs)  # type: ignore[arg-type]
