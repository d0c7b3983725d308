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

from functools import lru_cache

import torch

#: Rows per band: wide enough that each rectangle is an efficient GEMM, narrow enough that
#: the diagonal blocks (the only wasted work) stay small.
TILE = 128


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


@lru_cache(maxsize=64)
def _triu_index(b: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of a b x b block's upper triangle (row-major) and of its mirror."""
    rows, cols = torch.triu_indices(b, b, device=device)
    return rows * b + cols, cols * b + rows


def syrk(rows: torch.Tensor) -> torch.Tensor:
    """``rows^T rows`` per group, computed and returned as packed upper triangles.

    Args:
        rows: [groups, N, n].

    Returns:
        [groups * n (n + 1) / 2], each group's triangle in the band layout.
    """
    groups, _, n = rows.shape
    per = packed_numel(n)
    out = rows.new_empty(groups * per)
    for g in range(groups):
        x = rows[g]
        flat = out[g * per : (g + 1) * per]
        for i, j, off in bands(n):
            b = j - i
            xi = x[:, i:j].t()
            upper, _ = _triu_index(b, str(x.device))
            tri = b * (b + 1) // 2
            torch.index_select(torch.mm(xi, x[:, i:j]).view(-1), 0, upper,
                               out=flat[off : off + tri])  # fmt: skip
            if j < n:
                torch.mm(xi, x[:, j:], out=flat[off + tri : off + tri + b * (n - j)].view(b, n - j))
    return out


def pack(matrix: torch.Tensor) -> torch.Tensor:
    """Upper triangles of a [groups, n, n] matrix in the band layout (lower never read)."""
    groups, n, _ = matrix.shape
    per = packed_numel(n)
    out = matrix.new_empty(groups * per)
    for g in range(groups):
        m = matrix[g]
        flat = out[g * per : (g + 1) * per]
        for i, j, off in bands(n):
            b = j - i
            upper, _ = _triu_index(b, str(m.device))
            tri = b * (b + 1) // 2
            flat[off : off + tri] = m[i:j, i:j].reshape(-1).index_select(0, upper)
            if j < n:
                flat[off + tri : off + tri + b * (n - j)].view(b, n - j).copy_(m[i:j, j:])
    return out


def unpack(flat: torch.Tensor, n: int, groups: int, *, mirror: bool = True) -> torch.Tensor:
    """Inverse of `pack`: [groups, n, n], symmetric with `mirror`, else zero below."""
    per = packed_numel(n)
    out = flat.new_zeros(groups, n, n)
    for g in range(groups):
        src = flat[g * per : (g + 1) * per]
        m = out[g]
        for i, j, off in bands(n):
            b = j - i
            upper, lower = _triu_index(b, str(flat.device))
            tri = b * (b + 1) // 2
            block = flat.new_zeros(b * b)
            block.index_copy_(0, upper, src[off : off + tri])
            if mirror:
                block.index_copy_(0, lower, src[off : off + tri])
            m[i:j, i:j] = block.view(b, b)
            if j < n:
                rect = src[off + tri : off + tri + b * (n - j)].view(b, n - j)
                m[i:j, j:] = rect
                if mirror:
                    m[j:, i:j] = rect.t()
    return out
