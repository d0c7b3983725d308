"""Who inverts which factor, and who preconditions which layer.

Inverting (or eigendecomposing) a factor of side n costs ~n^3, and a model's factors span
three orders of magnitude (a CIFAR ResNet-18 has 27 x 27 and 4608 x 4608 ones), so the
assignment decides the inversion makespan. Three policies:

- ``round-robin``: factor i goes to worker i mod p (textbook distributed K-FAC);
- ``greedy``: whole layers, heaviest first, each to the least-loaded worker (KAISA);
- ``lpt``: longest processing time first over single factors (SPD-KFAC), and a factor whose
  inversion costs less than broadcasting its result is inverted by every worker itself.
  "Less" counts every worker's copy: p local inversions must cost less than one broadcast,
  so on a slow network only small factors qualify, not every factor whose broadcast is slow.

Who preconditions (the distribution): every worker (``comm-opt``: inverses are broadcast,
gradients are not), only the layer's inverting worker (``mem-opt``: it broadcasts the
preconditioned gradient instead), or a block of `group_size` workers (``hybrid``: inverses
are broadcast inside the block, gradients from each block member to the ranks of the other
blocks at the same position).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from plait.comm.stats import Collective
from plait.kfac.costs import KFACCosts
from plait.kfac.factors import Method, second_order_numel
from plait.kfac.layers import FactorKind, KFACLayer

#: `Assignment.inv_rank` value of a factor that every (grad) worker inverts itself.
LOCAL = -1


class PlacementPolicy(StrEnum):
    ROUND_ROBIN = "round-robin"
    GREEDY = "greedy"
    LPT = "lpt"


class Distribution(StrEnum):
    COMM_OPT = "comm-opt"
    MEM_OPT = "mem-opt"
    HYBRID = "hybrid"
    AUTO = "auto"  # the one the cost model prices cheapest per step (`choose_distribution`)


def factor_key(layer: str, kind: FactorKind) -> str:
    return f"{layer}/{kind}"


@dataclass(frozen=True, kw_only=True)
class FactorWork:
    """One factor to place: its estimated inversion seconds and result size in bytes."""

    layer: str
    kind: FactorKind
    inverse_s: float
    result_bytes: int

    @property
    def key(self) -> str:
        return factor_key(self.layer, self.kind)


@dataclass(frozen=True, kw_only=True)
class LayerWork:
    """One layer: its two factors, its preconditioning seconds and gradient bytes."""

    name: str
    a: FactorWork
    g: FactorWork
    grad_bytes: int
    precondition_s: float = 0.0

    @property
    def inverse_s(self) -> float:
        return self.a.inverse_s + self.g.inverse_s


#: Seconds to broadcast `nbytes` among `ranks` workers.
BroadcastCost = Callable[[int, int], float]


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """The result: inverting rank per factor, owning rank per layer, block structure.

    Attributes:
        world: number of workers.
        group_size: gradient workers per layer (world for comm-opt, 1 for mem-opt).
        inv_rank: factor key -> rank inverting it, or LOCAL.
        layer_rank: layer -> its owner (the block holding it); LOCAL for local layers.
        loads: modelled inversion seconds per worker (local work included).
    """

    world: int
    group_size: int
    inv_rank: dict[str, int]
    layer_rank: dict[str, int]
    loads: list[float] = field(default_factory=list)

    @property
    def makespan_s(self) -> float:
        return max(self.loads, default=0.0)

    def block_of(self, rank: int) -> tuple[int, ...]:
        start = rank // self.group_size * self.group_size
        return tuple(range(start, start + self.group_size))

    def blocks(self) -> list[tuple[int, ...]]:
        return [self.block_of(b) for b in range(0, self.world, self.group_size)]

    def receivers_of(self, rank: int) -> tuple[int, ...]:
        """Ranks that take a preconditioned gradient from `rank` (same position, all blocks)."""
        return tuple(range(rank % self.group_size, self.world, self.group_size))

    def receiver_groups(self) -> list[tuple[int, ...]]:
        return [self.receivers_of(j) for j in range(self.group_size)]

    def grad_workers(self, layer: str) -> tuple[int, ...]:
        owner = self.layer_rank[layer]
        if owner == LOCAL or self.group_size == self.world:
            return tuple(range(self.world))
        return self.block_of(owner)

    def grad_source(self, layer: str, rank: int) -> int:
        """The grad worker whose preconditioned gradient `rank` uses (itself if a worker)."""
        workers = self.grad_workers(layer)
        if rank in workers:
            return rank
        return workers[rank % self.group_size]

    def inverse_group(self, layer: str) -> tuple[int, ...]:
        """Ranks that receive this layer's inverses."""
        return self.grad_workers(layer)


def _min_load(loads: list[float]) -> int:
    return min(range(len(loads)), key=lambda r: (loads[r], r))


def lpt(costs: Sequence[float], world: int, *, base: Sequence[float] | None = None) -> list[int]:
    """Longest processing time first: heaviest item to the least-loaded worker."""
    loads = list(base) if base is not None else [0.0] * world
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = _min_load(loads)
        out[i] = r
        loads[r] += costs[i]
    return out


def assign(
    layers: Sequence[LayerWork],
    *,
    world: int,
    policy: PlacementPolicy,
    distribution: Distribution,
    group_size: int | None = None,
    broadcast_s: BroadcastCost | None = None,
    inv_interval: int = 1,
) -> Assignment:
    """Place every factor's inversion and every layer's preconditioning.

    Args:
        layers: the layers in a fixed order (the same on every rank).
        world: number of workers.
        policy: round-robin, greedy or lpt.
        distribution: comm-opt, mem-opt or hybrid.
        group_size: grad workers per layer for hybrid (must divide `world`).
        broadcast_s: broadcast cost model; with it, factors (comm-opt) or layers (mem-opt,
            hybrid) whose inversion is cheaper than the communication it replaces are
            handled by every worker itself (LOCAL). Without it nothing is local.
        inv_interval: steps between inversions; `lpt` on whole layers balances the per-step
            work, inversion amortised over it plus preconditioning every step.

    Raises:
        ValueError: a group size that does not divide the world.
    """
    if distribution is Distribution.AUTO:
        raise ValueError("resolve Distribution.AUTO with choose_distribution first")
    if distribution is Distribution.COMM_OPT:
        size = world
    elif distribution is Distribution.MEM_OPT:
        size = 1
    else:
        size = group_size if group_size is not None else max(1, world // 2)
    if size < 1 or world % size:
        raise ValueError(f"hybrid group size {size} must be >= 1 and divide world size {world}")
    inv_rank: dict[str, int] = {}
    layer_rank: dict[str, int] = {}
    loads = [0.0] * world
    colocated = distribution is not Distribution.COMM_OPT or policy is PlacementPolicy.GREEDY

    if not colocated:
        factors = [f for layer in layers for f in (layer.a, layer.g)]
        local = {
            f.key
            for f in factors
            if broadcast_s is not None and world > 1
            and world * f.inverse_s < broadcast_s(f.result_bytes, world)
        }  # fmt: skip
        base = sum(f.inverse_s for f in factors if f.key in local)
        placed = [f for f in factors if f.key not in local]
        if policy is PlacementPolicy.ROUND_ROBIN:
            ranks = [i % world for i in range(len(placed))]
        else:
            ranks = lpt([f.inverse_s for f in placed], world)
        loads = [base] * world
        for f, r in zip(placed, ranks, strict=True):
            inv_rank[f.key] = r
            loads[r] += f.inverse_s
        for f in factors:
            if f.key in local:
                inv_rank[f.key] = LOCAL
        for layer in layers:
            layer_rank[layer.name] = inv_rank[layer.a.key]
        return Assignment(world=world, group_size=size, inv_rank=inv_rank,
                          layer_rank=layer_rank, loads=loads)  # fmt: skip

    def saved_s(layer: LayerWork) -> float:
        """Communication a local layer avoids: its inverses in the block, its gradient out."""
        assert broadcast_s is not None
        inv = 0.0 if size == 1 else broadcast_s(layer.a.result_bytes + layer.g.result_bytes, size)
        grad = 0.0 if size == world else broadcast_s(layer.grad_bytes, world // size)
        return inv + grad

    def work_s(layer: LayerWork) -> float:
        if policy is PlacementPolicy.GREEDY:  # KAISA balances the n^3 inversion cost only
            return layer.inverse_s
        return layer.inverse_s / inv_interval + (layer.precondition_s if size < world else 0.0)

    local_layers = {
        layer.name
        for layer in layers
        if broadcast_s is not None
        and world > 1
        and world * (layer.inverse_s + layer.precondition_s) < saved_s(layer)
    }
    base = sum(work_s(layer) for layer in layers if layer.name in local_layers)
    placed_layers = [layer for layer in layers if layer.name not in local_layers]
    if policy is PlacementPolicy.ROUND_ROBIN:
        ranks = [i % world for i in range(len(placed_layers))]
    else:
        ranks = lpt([work_s(layer) for layer in placed_layers], world)
    loads = [base] * world
    for layer, r in zip(placed_layers, ranks, strict=True):
        layer_rank[layer.name] = r
        inv_rank[layer.a.key] = inv_rank[layer.g.key] = r
        loads[r] += work_s(layer)
    for layer in layers:
        if layer.name in local_layers:
            layer_rank[layer.name] = LOCAL
            inv_rank[layer.a.key] = inv_rank[layer.g.key] = LOCAL
    return Assignment(world=world, group_size=size, inv_rank=inv_rank, layer_rank=layer_rank,
                      loads=loads)  # fmt: skip


def choose_distribution(
    layers: Sequence[LayerWork],
    *,
    world: int,
    broadcast_s: BroadcastCost,
    inv_interval: int = 1,
) -> tuple[Distribution, int]:
    """The distribution (and block size) with the least modelled seconds per step.

    Per step, each candidate pays its preconditioning (all layers on every worker for
    comm-opt, a 1/p share for mem-opt, s/p for hybrid blocks of s), the broadcast of the
    inverses to the block amortised over `inv_interval`, and the broadcast of preconditioned
    gradients out of the block. On a fast network the shared preconditioning wins; on a
    slow one with rare inversions, broadcasting inverses once beats gradients every step.
    """
    if world <= 1:
        return Distribution.COMM_OPT, 1
    total_pre = sum(layer.precondition_s for layer in layers)

    def cost(size: int) -> float:
        pre = total_pre * size / world
        inv = sum(
            broadcast_s(layer.a.result_bytes + layer.g.result_bytes, size) for layer in layers
        ) / inv_interval if size > 1 else 0.0  # fmt: skip
        grad = sum(broadcast_s(layer.grad_bytes, world // size) for layer in layers) if (
            size < world
        ) else 0.0  # fmt: skip
        return pre + inv + grad

    sizes = [s for s in range(1, world + 1) if world % s == 0]
    best = min(sizes, key=lambda s: (cost(s), -s))
    if best == world:
        return Distribution.COMM_OPT, world
    if best == 1:
        return Distribution.MEM_OPT, 1
    return Distribution.HYBRID, best


def layer_work(layer: KFACLayer, *, method: Method, packed: bool, costs: KFACCosts) -> LayerWork:
    """The placement's view of one layer, priced with `costs`."""
    works = [
        FactorWork(
            layer=layer.name,
            kind=kind,
            inverse_s=costs.inverse_s_per_n3 * layer.shape(kind).inverse_cost,
            result_bytes=4 * second_order_numel(method, layer.shape(kind), packed=packed),
        )
        for kind in (FactorKind.A, FactorKind.G)
    ]
    return LayerWork(
        name=layer.name,
        a=works[0],
        g=works[1],
        grad_bytes=4 * layer.grad_numel,
        precondition_s=costs.flop_s * precondition_flops(layer, method),
    )


def precondition_flops(layer: KFACLayer, method: Method) -> float:
    """Matmul flops of preconditioning one layer's gradient."""
    a, g = layer.a_shape, layer.g_shape
    na, ng = float(a.dim), float(g.dim)
    flops = 2 * g.groups * (ng * ng * na + (0.0 if a.diagonal else ng * na * na))
    return 2 * flops if method is Method.EIGEN else flops


@dataclass(frozen=True, kw_only=True)
class Placement:
    """What `plan_placement` decided: the distribution and the assignment under it."""

    distribution: Distribution
    assignment: Assignment


def plan_placement(
    layers: Sequence[KFACLayer],
    *,
    world: int,
    costs: KFACCosts,
    method: Method,
    packed: bool,
    policy: PlacementPolicy,
    distribution: Distribution,
    group_size: int | None = None,
    local_inversion: bool = True,
    inv_interval: int = 1,
) -> Placement:
    """Price the layers with `costs` and place them on `world` workers.

    A pure function of its arguments (no process group, no clock), so every rank that
    holds the same costs computes the same placement, and a test can check the decisions
    for any world size and any network by handing in the costs.

    Args:
        layers: the layers in a fixed order (the same on every rank).
        world: number of workers.
        costs: link and compute prices.
        method: the decomposition (its result sizes and preconditioning cost differ).
        packed: whether inverse-method results travel as triangles.
        policy: round-robin, greedy or lpt.
        distribution: comm-opt, mem-opt, hybrid, or auto (the cheapest under `costs`).
        group_size: hybrid block size (None: half the world).
        local_inversion: let every worker invert what is cheaper than receiving it.
        inv_interval: steps between inversions.
    """
    works = [layer_work(layer, method=method, packed=packed, costs=costs) for layer in layers]

    def broadcast_s(nbytes: int, ranks: int) -> float:
        return costs.link.time(Collective.BROADCAST, nbytes, ranks)

    size = group_size
    if distribution is Distribution.AUTO:
        distribution, size = choose_distribution(
            works, world=world, broadcast_s=broadcast_s, inv_interval=inv_interval
        )
    asg = assign(
        works,
        world=world,
        policy=policy,
        distribution=distribution,
        group_size=size,
        broadcast_s=broadcast_s if local_inversion else None,
        inv_interval=inv_interval,
    )
    return Placement(distribution=distribution, assignment=asg)


@dataclass(frozen=True, kw_only=True)
class PlacementProvider:
    """The placement policy `KFAC` is handed: prices and settings, asked for a placement
    at the first step and again whenever the intervals change (the inversion interval
    weighs inversion against preconditioning and against broadcasting). A pure function
    of its fields and arguments, so every rank asked with the same arguments places alike,
    and a test asks it for any world size without a process group.

    Attributes:
        costs: link and compute prices.
        method: the decomposition (its result sizes and preconditioning cost differ).
        packed: whether inverse-method results travel as triangles.
        policy: round-robin, greedy or lpt.
        distribution: comm-opt, mem-opt, hybrid, or auto (the cheapest under `costs`).
        grad_workers: hybrid block size (None: half the world).
        local_inversion: let every worker invert what is cheaper than receiving it.
    """

    costs: KFACCosts
    method: Method
    packed: bool = True
    policy: PlacementPolicy = PlacementPolicy.LPT
    distribution: Distribution = Distribution.COMM_OPT
    grad_workers: int | None = None
    local_inversion: bool = True

    def group_size(self, world: int) -> int | None:
        """The block size the settings ask for on `world` workers (None: decided by cost).

        Raises:
            ValueError: a hybrid block size that does not divide the world.
        """
        d = self.distribution
        if d is Distribution.AUTO:
            return None
        if d is Distribution.COMM_OPT:
            return world
        if d is Distribution.MEM_OPT:
            return 1
        size = min(self.grad_workers or max(1, world // 2), world)
        if world % size:
            raise ValueError(f"grad_workers={size} must divide the world size {world}")
        return size

    def plan(self, layers: Sequence[KFACLayer], *, world: int, inv_interval: int) -> Placement:
        """Place `layers` (in model order, the same on every rank) on `world` workers."""
        return plan_placement(
            layers,
            world=world,
            costs=self.costs,
            method=self.method,
            packed=self.packed,
            policy=self.policy,
            distribution=self.distribution,
            group_size=self.group_size(world),
            local_inversion=self.local_inversion,
            inv_interval=inv_interval,
        )
