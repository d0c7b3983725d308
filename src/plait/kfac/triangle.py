"""Symmetric matrices stored as tiled upper triangles, and computed that way.

A Kronecker factor is ``X^T X`` over the rows ``X`` of a layer, and for convolutions that
product costs more than the layer's forward and backward together (a CIFAR ResNet-18 at
batch 8 spends ~75 GFLOP on its A factors against ~13 on forward and backward). Half of
it is the lower triangle, which nobody reads: factors travel as upper triangles and the
decompositions read only the upper triangle.

So the upper triangle is cut into row bands of `TILE` rows. Band ``[i, j)`` holds the
upper triangle of its diagonal block (row-major) followed by the dense rectangle
``[i, j) x [j, n)``. The rectangle is one GEMM written in place into the wire buffer
(``X[:, i:j]^T X[:, j:]``), the diagonal block a small GEMM whose triangle is copied;
together they skip the lower triangle's off-diagonal blocks (about 40% of the FLOPs at
n = 576, more for wider factors) and the gather that packing a dense matrix needs. The
size is exactly ``n (n + 1) / 2`` per block, and for ``n <= TILE`` the layout is the
plain row-major upper triangle.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch

#: Rows per band: wide enough that each rectangle is an efficient GEMM, narrow enough that
#: the diagonal blocks (the only wasted work) stay small.
TILE = 128

#: Up to this size one batched product and one gather of the layout (one scatter to unpack)
#: beat the band walk on the CPU, whose per-band operators then cost more than the lower
#: triangle's FLOPs it skips: at n = 144 34 against 75 us for 32 rows (K-FAC-reduce) and
#: 544 against 635 us for 2048 rows; level at n = 200, tiling ahead beyond (one thread).
GATHER_MAX = 192


def packed_numel(n: int) -> int:
    return n * (n + 1) // 2


@lru_cache(maxsize=256)
def bands(n: int) -> tuple[tuple[int, int, int], ...]:
    """``(start, stop, offset)`` of each band: its rows and where it begins in the buffer."""
    out = []
    offset = 0
    for i in range(0, n, TILE):
        j = min(i + TILE, n)
        b = j - i
        out.append((i, j, offset))
        offset += b * (b + 1) // 2 + b * (n - j)
    return tuple(out)


@dataclass(frozen=True)
class _Band:
    """Band ``[start, stop)`` of group `group`, and where its two parts lie in the buffer."""

    group: int
    start: int
    stop: int
    tri: slice  # the diagonal block's upper triangle, row-major
    rect: slice  # the rectangle [start, stop) x [stop, n), row-major


def _walk(n: int, groups: int) -> Iterator[_Band]:
    per = packed_numel(n)
    for g in range(groups):
        for i, j, off in bands(n):
            b = j - i
            tri = off + g * per + b * (b + 1) // 2
            yield _Band(group=g, start=i, stop=j, tri=slice(off + g * per, tri),
                        rect=slice(tri, tri + b * (n - j)))  # fmt: skip


@lru_cache(maxsize=64)
def _triu_index(b: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of a b x b block's upper triangle (row-major) and of its mirror."""
    rows, cols = torch.triu_indices(b, b, device=device)
    return rows * b + cols, cols * b + rows


@lru_cache(maxsize=256)
def _band_index(n: int, device: str) -> torch.Tensor:
    """Flat positions in an n x n matrix of the band layout's entries, in layout order
    (for ``n <= TILE``, the upper triangle's, row-major)."""
    parts = []
    for i, j, _ in bands(n):
        upper, _ = _triu_index(j - i, "cpu")
        rows, cols = upper // (j - i) + i, upper % (j - i) + i
        parts.append(rows * n + cols)
        r = torch.arange(i, j).unsqueeze(1) * n + torch.arange(j, n).unsqueeze(0)
        parts.append(r.reshape(-1))
    return torch.cat(parts).to(device)


def syrk(rows: torch.Tensor, *, dense: bool | None = None) -> torch.Tensor:
    """``rows^T rows`` per group, computed and returned as packed upper triangles.

    On the CPU a product wider than `GATHER_MAX` is tiled so that it skips the lower
    triangle (narrower ones take the gather below). On CUDA
    (`dense` None picks by device) one batched product of the whole matrix and one gather
    of the layout are faster: the tiles are one kernel launch each, and the H200 ran the
    digits CNN's and ResNet-18's factor updates launch-bound, their GEMMs a few
    microseconds each, in 2600 launches over five steps.

    Args:
        rows: [groups, N, n].
        dense: compute the full product and gather (the CUDA default), or tile (the CPU
            default).

    Returns:
        [groups * n (n + 1) / 2], each group's triangle in the band layout.
    """
    groups, _, n = rows.shape
    if dense is None:
        dense = rows.is_cuda
    if dense or n <= GATHER_MAX:  # one batched product, the layout gathered from it
        full = torch.bmm(rows.transpose(1, 2), rows).view(groups, n * n)
        return full.index_select(1, _band_index(n, str(rows.device))).view(-1)
    out = rows.new_empty(groups * packed_numel(n))
    for band in _walk(n, groups):
        x, i, j = rows[band.group], band.start, band.stop
        upper, _ = _triu_index(j - i, str(x.device))
        xi = x[:, i:j].t()
        torch.index_select(torch.mm(xi, x[:, i:j]).view(-1), 0, upper, out=out[band.tri])
        if j < n:
            torch.mm(xi, x[:, j:], out=out[band.rect].view(j - i, n - j))
    return out


@lru_cache(maxsize=256)
def _mirror_index(n: int, device: str) -> torch.Tensor:
    """Flat positions of the mirror images (below the diagonal) of `_band_index`'s."""
    idx = _band_index(n, "cpu")
    return (idx % n * n + idx // n).to(device)


def pack(matrix: torch.Tensor) -> torch.Tensor:
    """Upper triangles of a [groups, n, n] matrix in the band layout (lower never read)."""
    groups, n, _ = matrix.shape
    if n <= GATHER_MAX:  # one gather for every group (the band walk: 4 ops a band)
        flat = matrix.reshape(groups, n * n)
        return flat.index_select(1, _band_index(n, str(matrix.device))).view(-1)
    out = matrix.new_empty(groups * packed_numel(n))
    for band in _walk(n, groups):
        m, i, j = matrix[band.group], band.start, band.stop
        upper, _ = _triu_index(j - i, str(m.device))
        out[band.tri] = m[i:j, i:j].reshape(-1).index_select(0, upper)
        out[band.rect] = m[i:j, j:].reshape(-1)
    return out


def unpack(flat: torch.Tensor, n: int, groups: int, *, mirror: bool = True) -> torch.Tensor:
    """Inverse of `pack`: [groups, n, n], symmetric with `mirror`, else zero below."""
    out = flat.new_zeros(groups, n, n)
    if n <= GATHER_MAX:  # one scatter (two with the mirror) for every group
        dst, src, device = out.view(groups, n * n), flat.view(groups, -1), str(flat.device)
        dst.index_copy_(1, _band_index(n, device), src)
        if mirror:
            dst.index_copy_(1, _mirror_index(n, device), src)
        return out
    for band in _walk(n, groups):
        m, i, j = out[band.group], band.start, band.stop
        upper, lower = _triu_index(j - i, str(flat.device))
        block = flat.new_zeros((j - i) ** 2)
        block.index_copy_(0, upper, flat[band.tri])
        if mirror:
            block.index_copy_(0, lower, flat[band.tri])
        m[i:j, i:j] = block.view(j - i, j - i)
        rect = flat[band.rect].view(j - i, n - j)
        m[i:j, j:] = rect
        if mirror:
            m[j:, i:j] = rect.t()
    return out
