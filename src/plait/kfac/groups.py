"""`ProcessGroups`: the data-parallel group K-FAC works on, and the sub-groups it needs.

Distribution (`plait.kfac.placement`) broadcasts decompositions inside blocks of gradient
workers and preconditioned gradients to the ranks at the same position of every block, so
K-FAC needs a process group per block and per position. Creating a group is collective
(every rank of the job must call it, in the same order), so the groups are made here, from
the block size alone, the same way on every rank, and kept.

The object is handed to `KFAC`; its `factory` makes one group from global ranks
(`plait.distributed.new_group` by default). A test builds it for any world size and rank
with a factory that records what it is asked for, without a process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from plait.distributed import new_group

#: Makes one process group from a list of global ranks (collective over the whole job).
GroupFactory = Callable[[list[int]], Any]


class ProcessGroups:
    """A data-parallel group of `world` workers, this worker's `rank` in it, and sub-groups.

    Args:
        world: workers in the group.
        rank: this worker's rank in the group.
        ranks: the group's global ranks (None: 0 .. world-1).
        factory: makes a group from global ranks; called for the whole group at once (when
            `world` > 1) and for each sub-group `ensure` needs.

    Raises:
        ValueError: a rank outside the group, or a rank list of the wrong length.
    """

    def __init__(
        self,
        world: int = 1,
        rank: int = 0,
        *,
        ranks: Sequence[int] | None = None,
        factory: GroupFactory = new_group,
    ) -> None:
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a group of {world}")
        if ranks is not None and len(ranks) != world:
            raise ValueError(f"{len(ranks)} global ranks for a group of {world}")
        self.world, self.rank = world, rank
        self.ranks = list(ranks) if ranks is not None else None
        self.factory = factory
        self._groups: dict[tuple[int, ...], Any] = {}
        self.group: Any = None
        if world > 1:
            self.group = factory(self.ranks or list(range(world)))
            self._groups[tuple(range(world))] = self.group

    @classmethod
    def of(cls, group: Any = None, *, factory: GroupFactory = new_group) -> ProcessGroups:
        """The groups of torch.distributed's `group` (None: the default group), or of one
        process when torch.distributed is not initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(factory=factory)
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        return cls(dist.get_world_size(group), dist.get_rank(group), ranks=ranks, factory=factory)

    def global_rank(self, rank: int) -> int:
        """The global rank of group rank `rank` (what collectives name as source)."""
        return self.ranks[rank] if self.ranks else rank

    def ensure(self, size: int) -> None:
        """Make the block and receiver groups of blocks of `size` workers (collective: every
        rank calls it with the same size, in the same order)."""
        if self.world <= 1:
            return
        tuples: list[tuple[int, ...]] = []
        if 1 < size < self.world:
            tuples += [tuple(range(b, b + size)) for b in range(0, self.world, size)]
        if size < self.world and self.world // size > 1:
            tuples += [tuple(range(j, self.world, size)) for j in range(size)]
        for t in tuples:
            if t not in self._groups:
                self._groups[t] = self.factory([self.global_rank(i) for i in t])

    def get(self, ranks: tuple[int, ...]) -> Any:
        """The group of these group ranks (the whole group, or one `ensure` made)."""
        return self._groups[ranks]

    @property
    def made(self) -> list[tuple[int, ...]]:
        """The rank tuples of every group made so far, in the order they were made."""
        return list(self._groups)
