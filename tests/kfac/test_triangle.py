"""Tiled upper triangles: the GEMM-built sums and the packed layout against dense torch."""

from __future__ import annotations

import pytest
import torch

from plait.kfac import triangle

# One band, exactly one band, one row more than a band, and several bands with a ragged
# last one: every branch of the band layout; on both sides of the gather's limit.
DIMS = [1, 5, triangle.TILE, triangle.TILE + 1, triangle.GATHER_MAX, triangle.GATHER_MAX + 1,
        2 * triangle.TILE + 44]  # fmt: skip


@pytest.mark.parametrize("n", DIMS)
def test_bands_cover_the_triangle_once(n: int) -> None:
    bands = triangle.bands(n)
    assert bands[0][0] == 0 and bands[-1][1] == n
    end = 0
    for (i, j, off), nxt in zip(bands, [*bands[1:], None], strict=True):
        assert i == end and j > i
        end = j
        b = j - i
        size = b * (b + 1) // 2 + b * (n - j)
        assert off + size == (nxt[2] if nxt else triangle.packed_numel(n))


@pytest.mark.parametrize("n", DIMS)
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("tiled", [True, False])
def test_syrk_is_the_packed_gram_matrix(n: int, groups: int, tiled: bool) -> None:
    """Tiled (the CPU's path) and dense then gathered (the CUDA path) alike."""
    # float64 so that the only difference to a dense matmul is summation order (~1e-15).
    rows = torch.randn(groups, 37, n, dtype=torch.float64)
    dense = rows.transpose(1, 2) @ rows
    flat = triangle.syrk(rows, dense=not tiled)
    assert flat.shape == (groups * triangle.packed_numel(n),)
    torch.testing.assert_close(flat, triangle.pack(dense))
    torch.testing.assert_close(triangle.unpack(flat, n, groups), dense)


@pytest.mark.parametrize("n", DIMS)
def test_pack_reads_only_the_upper_triangle_and_mirrors_exactly(n: int) -> None:
    x = torch.randn(2, n, n, dtype=torch.float64)
    sym = x + x.transpose(1, 2)
    garbage = torch.triu(sym) + torch.tril(torch.full_like(sym, 1e3), -1)
    flat = triangle.pack(garbage)
    full = triangle.unpack(flat, n, 2)
    assert torch.equal(full, sym.triu() + sym.triu(1).transpose(1, 2))
    assert torch.equal(full, full.transpose(1, 2))  # bit-exact: replicas never drift apart
    assert torch.equal(triangle.unpack(flat, n, 2, mirror=False), torch.triu(sym))
