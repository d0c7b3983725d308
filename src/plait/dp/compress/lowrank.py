"""Low-rank compression machinery shared by Power-SGD and ACP-SGD.

A gradient of shape (n, ...) is viewed as an n x m matrix M and approximated by P Q^T with
P (n x r) and Q (m x r). Factors are stored *transposed* (r x n, r x m): the products
this layout needs (Q^T M^T and P^T M) run several times faster on a CPU than M Q and
M^T P, whose skinny right-hand side defeats the matrix-multiply kernels.

Matrices of one shape in one bucket form a *group* whose error buffers and factors live
in one batched tensor, so compression is a few batched calls per group, not a Python loop
per tensor. State belongs to parameters (see `plait.dp.compress.base`): when DDP changes
its buckets, the new groups take over each parameter's error and factors.
"""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import torch
from torch._C._distributed_c10d import GradBucket

from plait.dp.compress.base import Compressor, check_positive

#: Factors below this norm are degenerate (an all-zero gradient) when orthonormalising.
_EPS = 1e-12


@dataclass(frozen=True, kw_only=True)
class RankPolicy:
    """Which rank each gradient matrix gets, or whether it travels uncompressed.

    A tensor of fewer than two dimensions always travels uncompressed. A matrix gets
    ``min(rank, n, m)`` (or the rank of the first matching `layer_ranks` pattern) and is
    compressed only if that saves at least `min_compression_rate`: n*m > rate * (n+m)*r.

    Attributes:
        rank: default rank, > 0.
        min_compression_rate: smallest worthwhile n*m / ((n+m)*r), >= 1.
        layer_ranks: (fnmatch pattern on the parameter name, rank) pairs, first match
            wins; rank 0 sends that parameter uncompressed.
    """

    rank: int
    min_compression_rate: float = 2.0
    layer_ranks: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        check_positive("rank", self.rank, integer=True)
        check_positive("min_compression_rate", self.min_compression_rate)
        if self.min_compression_rate < 1:
            raise ValueError(f"min_compression_rate must be >= 1, got {self.min_compression_rate}")
        for pattern, r in self.layer_ranks:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"layer rank for {pattern!r} must be an integer >= 0, got {r!r}")

    def rank_for(self, name: str, shape: Sequence[int]) -> int:
        """The rank of the parameter `name` of `shape`; 0 means send it uncompressed."""
        if len(shape) < 2:
            return 0
        n, m = matrix_shape(shape)
        rank = next((r for p, r in self.layer_ranks if fnmatch.fnmatchcase(name, p)), self.rank)
        r = min(rank, n, m)
        if r == 0 or n * m <= self.min_compression_rate * (n + m) * r:
            return 0
        return r


def parse_layer_ranks(spec: str | Mapping[str, int] | None) -> tuple[tuple[str, int], ...]:
    """Layer ranks from a mapping or from ``"pattern:rank;pattern:rank"`` (command line)."""
    if spec is None or spec == "":
        return ()
    if isinstance(spec, Mapping):
        return tuple((str(k), v) for k, v in spec.items())
    out: list[tuple[str, int]] = []
    for item in filter(None, (s.strip() for s in str(spec).split(";"))):
        pattern, sep, rank = item.rpartition(":")
        if not sep or not pattern:
            raise ValueError(f"invalid layer rank {item!r}: expected pattern:rank")
        try:
            out.append((pattern, int(rank)))
        except ValueError:
            raise ValueError(f"invalid layer rank {item!r}: {rank!r} is not an integer") from None
    return tuple(out)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The (n, m) matrix view of a tensor: first dimension by the rest."""
    n = int(shape[0])
    m = 1
    for s in shape[1:]:
        m *= int(s)
    return n, m


def orthonormalize_rows_(x: torch.Tensor) -> torch.Tensor:
    """Make the r rows of each [k, r, d] matrix orthonormal, in place.

    QR where LAPACK has the dtype; Gram-Schmidt (in float32) for fp16/bf16, which CPU QR
    lacks. A degenerate row (from an all-zero gradient) becomes a unit vector, as QR does,
    so a factor never collapses to zero and stalls its layer for good.
    """
    if x.dtype in (torch.float32, torch.float64):
        q, _ = torch.linalg.qr(x.transpose(1, 2))
        x.copy_(q.transpose(1, 2))
        return x
    y = x.float()
    r = y.shape[1]
    for i in range(r):
        v = y[:, i]
        _project_out(v, y[:, :i])
        norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
        bad = norm < _EPS
        if bool(bad.any()):
            unit = torch.zeros_like(v)
            unit[:, i % v.shape[-1]] = 1.0
            v.copy_(torch.where(bad, unit, v))
            _project_out(v, y[:, :i])
            norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
        v.div_(norm.clamp_min(_EPS))
    x.copy_(y)
    return x


def _project_out(v: torch.Tensor, basis: torch.Tensor) -> None:
    """v -= its components along the orthonormal rows of `basis` ([k, d] and [k, j, d])."""
    for j in range(basis.shape[1]):
        b = basis[:, j]
        v.sub_((v * b).sum(-1, keepdim=True) * b)


#: Bytes of a decompressed matrix written per matrix product (a quarter of L2 here): MKL's
#: rank-r products write cache-sized row blocks about twice as fast as a whole matrix.
WRITE_CHUNK_BYTES = 256 * 1024


def write_product_(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """out := left @ right for an n x m `out`, n x r `left`, r x m `right`, in row blocks."""
    n, m = out.shape
    rows = max(1, WRITE_CHUNK_BYTES // max(1, m * out.element_size()))
    if rows >= n:
        torch.mm(left, right, out=out)
        return
    for i in range(0, n, rows):
        torch.mm(left[i : i + rows], right, out=out[i : i + rows])


def seeded_factor(seed: int, key: str, r: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An orthonormal r x dim factor drawn from (seed, key): identical on every rank."""
    salt = zlib.crc32(key.encode())
    gen = torch.Generator().manual_seed((seed * 0x9E3779B1 + salt) % (2**63))
    x = torch.randn(1, r, dim, generator=gen, dtype=torch.float32)
    return orthonormalize_rows_(x)[0].to(dtype)


@dataclass(kw_only=True)
class ParamState:
    """One parameter's low-rank state: error feedback and both (transposed) factors."""

    error: torch.Tensor  # n x m
    p: torch.Tensor  # r x n
    q: torch.Tensor  # r x m


@dataclass(kw_only=True)
class MatrixGroup:
    """Same-shaped matrices of one bucket, their state batched along dimension 0."""

    n: int
    m: int
    r: int
    slots: list[int]  # positions in bucket.gradients()
    names: list[str]
    error: torch.Tensor  # [k, n, m]
    p: torch.Tensor  # [k, r, n]
    q: torch.Tensor  # [k, r, m]
    errors: list[torch.Tensor] = field(default_factory=list)  # error.unbind(0), for foreach

    @property
    def k(self) -> int:
        return len(self.slots)

    def matrices(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This group's gradient views, n x m, into the bucket."""
        return [grads[i].view(self.n, self.m) for i in self.slots]


@dataclass(kw_only=True)
class BucketPlan:
    """How one DDP bucket is compressed: matrix groups plus uncompressed slots.

    The wire buffer of a step holds each group's factors ([k, r, n] for P, [k, r, m] for
    Q) followed by the uncompressed tensors, so each step sends ONE buffer.
    """

    groups: list[MatrixGroup]
    dense_slots: list[int]
    dense_numel: int
    dtype: torch.dtype
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    wire: dict[str, torch.Tensor] = field(default_factory=dict)

    def factor_numel(self, which: str) -> int:
        return sum(g.k * g.r * (g.n if which == "p" else g.m) for g in self.groups)

    def wire_buffer(self, which: str, *, dense: bool = True) -> torch.Tensor:
        """The reused flat send buffer for factor `which` ("p" or "q") [plus dense tensors]."""
        key = which + ("+dense" if dense else "")
        buf = self.wire.get(key)
        if buf is None:
            size = self.factor_numel(which) + (self.dense_numel if dense else 0)
            buf = torch.empty(size, dtype=self.dtype, device=self.device)
            self.wire[key] = buf
        return buf

    def factor_views(self, buf: torch.Tensor, which: str) -> list[torch.Tensor]:
        """Per group, the [k, r, n|m] view of `buf` holding that group's factors."""
        out, off = [], 0
        for g in self.groups:
            d = g.n if which == "p" else g.m
            size = g.k * g.r * d
            out.append(buf[off : off + size].view(g.k, g.r, d))
            off += size
        return out

    def dense_view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[buf.numel() - self.dense_numel :]

    def pack_dense(self, grads: Sequence[torch.Tensor], buf: torch.Tensor) -> None:
        if self.dense_slots:
            torch.cat([grads[i].reshape(-1) for i in self.dense_slots], out=self.dense_view(buf))

    def unpack_dense(self, grads: Sequence[torch.Tensor], buf: torch.Tensor) -> None:
        if not self.dense_slots:
            return
        dests = [grads[i].view(-1) for i in self.dense_slots]
        srcs = self.dense_view(buf).split([d.numel() for d in dests])
        torch._foreach_copy_(dests, list(srcs))


class LowRankStore:
    """Per-parameter low-rank state and the bucket plans built over it.

    Args:
        policy: ranks per parameter.
        seed: initial factors derive from (seed, parameter name) alone, so every rank
            starts from the same factors without communicating.
    """

    def __init__(self, *, policy: RankPolicy, seed: int) -> None:
        self.policy = policy
        self.seed = seed
        self.params: dict[str, ParamState] = {}
        self._plans: dict[tuple[int, ...], BucketPlan] = {}

    def plan(
        self,
        key: tuple[int, ...],
        names: Callable[[], Sequence[str]],
        grads: Sequence[torch.Tensor],
    ) -> BucketPlan:
        """The plan of the bucket whose parameters are identified by `key`.

        `names` (called only when the plan is new) names the bucket's parameters.
        """
        plan = self._plans.get(key)
        if plan is None:
            bucket_names = list(names())
            plan = self._build(bucket_names, grads)
            mine = set(bucket_names)
            # plans over any of these parameters now hold stale copies of their state
            self._plans = {
                k: p
                for k, p in self._plans.items()
                if not mine.intersection(n for g in p.groups for n in g.names)
            }
            self._plans[key] = plan
        return plan

    def _build(self, names: Sequence[str], grads: Sequence[torch.Tensor]) -> BucketPlan:
        dtype = grads[0].dtype if grads else torch.float32
        device = grads[0].device if grads else torch.device("cpu")
        by_shape: dict[tuple[int, int, int], list[int]] = {}
        dense: list[int] = []
        for i, (name, g) in enumerate(zip(names, grads, strict=True)):
            r = self.policy.rank_for(name, g.shape)
            if r == 0:
                dense.append(i)
            else:
                by_shape.setdefault((*matrix_shape(g.shape), r), []).append(i)
        groups = [
            self._group(
                n=n,
                m=m,
                r=r,
                slots=slots,
                names=[names[i] for i in slots],
                dtype=dtype,
                device=device,
            )
            for (n, m, r), slots in by_shape.items()
        ]
        return BucketPlan(
            groups=groups,
            dense_slots=dense,
            dense_numel=sum(grads[i].numel() for i in dense),
            dtype=dtype,
            device=device,
        )

    def _group(
        self,
        *,
        n: int,
        m: int,
        r: int,
        slots: list[int],
        names: list[str],
        dtype: torch.dtype,
        device: torch.device,
    ) -> MatrixGroup:
        k = len(slots)
        g = MatrixGroup(
            n=n,
            m=m,
            r=r,
            slots=slots,
            names=names,
            error=torch.zeros(k, n, m, dtype=dtype, device=device),
            p=torch.empty(k, r, n, dtype=dtype, device=device),
            q=torch.empty(k, r, m, dtype=dtype, device=device),
        )
        for j, name in enumerate(names):
            old = self.params.get(name)
            if old is not None:
                self._check(name, old, n, m, r)
                g.error[j].copy_(old.error)
                g.p[j].copy_(old.p)
                g.q[j].copy_(old.q)
            else:
                g.p[j].copy_(seeded_factor(self.seed, "p:" + name, r, n, dtype))
                g.q[j].copy_(seeded_factor(self.seed, "q:" + name, r, m, dtype))
            self.params[name] = ParamState(error=g.error[j], p=g.p[j], q=g.q[j])
        g.errors = list(g.error.unbind(0))
        return g

    @staticmethod
    def _check(name: str, s: ParamState, n: int, m: int, r: int) -> None:
        want = {"error": (n, m), "p": (r, n), "q": (r, m)}
        got = {"error": tuple(s.error.shape), "p": tuple(s.p.shape), "q": tuple(s.q.shape)}
        if got != want:
            raise ValueError(
                f"low-rank state of {name!r} has shapes {got}, the model needs {want} "
                "(checkpoint from another model or rank?)"
            )

    def state_dict(self) -> dict[str, Any]:
        """Copies (not views of live storage) of every parameter's state, by name."""
        return {
            name: {"error": s.error.clone(), "p": s.p.clone(), "q": s.q.clone()}
            for name, s in self.params.items()
        }

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Adopt saved per-parameter state; the next plans copy it into their groups."""
        params: dict[str, ParamState] = {}
        for name, s in state.items():
            try:
                params[name] = ParamState(error=s["error"], p=s["p"], q=s["q"])
            except KeyError as exc:
                raise ValueError(f"low-rank state of {name!r} lacks {exc.args[0]!r}") from None
        self.params = params
        self._plans = {}


class Phase(StrEnum):
    """What a step sends: everything dense (warm-up), or a P or Q factor per matrix."""

    DENSE = "dense"
    P = "p"
    Q = "q"


class LowRankCompressor(Compressor):
    """Options, per-parameter state, step counting and checkpoints of low-rank compressors.

    Args:
        group: process group.
        rank: default rank of each gradient matrix, > 0.
        min_compression_rate: matrices compressing less than this travel uncompressed.
        layer_ranks: per-parameter ranks, a mapping or ``"pattern:rank;..."`` (fnmatch on
            parameter names; 0 sends that parameter uncompressed).
        warmup: steps of plain all-reduce before compression starts (None: the method's
            `default_warmup`).
        seed: initial factors derive from (seed, parameter name), the same on every rank.
    """

    #: Dense warm-up steps when `warmup` is not given.
    default_warmup: ClassVar[int] = 0

    def __init__(
        self,
        *,
        group: Any = None,
        rank: int = 4,
        min_compression_rate: float = 2.0,
        layer_ranks: str | Mapping[str, int] | None = None,
        warmup: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(group=group)
        if warmup is None:
            warmup = self.default_warmup
        self.policy = RankPolicy(
            rank=rank,
            min_compression_rate=min_compression_rate,
            layer_ranks=parse_layer_ranks(layer_ranks),
        )
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.warmup = warmup
        self.seed = seed
        self.store = LowRankStore(policy=self.policy, seed=seed)
        #: Communicating steps begun so far (the parity of ACP-SGD lives here).
        self.steps = 0
        self._phase = Phase.DENSE

    def phase_of(self, step: int) -> Phase:
        """The phase of communicating step `step` (0-based)."""
        return Phase.DENSE if step < self.warmup else Phase.P

    def begin(self, bucket: GradBucket) -> Phase:
        """Advance the step on a step's first bucket (DDP hands buckets over in order)."""
        if bucket.index() == 0:
            self._phase = self.phase_of(self.steps)
            self.steps += 1
        return self._phase

    def plan(self, bucket: GradBucket, grads: Sequence[torch.Tensor]) -> BucketPlan:
        params = bucket.parameters()
        key = tuple(map(id, params))
        return self.store.plan(key, lambda: [self.param_name(p) for p in params], grads)

    def factor_nbytes(self, n: int, m: int, r: int) -> float:
        """Elements sent per step for an n x m matrix at rank r (Power-SGD: P and Q)."""
        return float((n + m) * r)

    def payload_nbytes(self, name: str, param: torch.Tensor) -> float:
        r = self.policy.rank_for(name, param.shape)
        if r == 0:
            return super().payload_nbytes(name, param)
        n, m = matrix_shape(param.shape)
        return self.factor_nbytes(n, m, r) * param.element_size()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "params": self.store.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"steps", "params"} - set(state)
        if missing:
            raise ValueError(f"{self.name} state lacks {sorted(missing)}")
        self.steps = int(state["steps"])
        self.store.load_state_dict(state["params"])
