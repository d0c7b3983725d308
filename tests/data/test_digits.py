"""`plait.data.digits`: a stratified, seeded, disjoint split of scikit-learn's digits."""

from __future__ import annotations

import pytest
import torch

from plait.data.digits import load_digits_split


def test_split_is_stratified_disjoint_and_scaled() -> None:
    train, test = load_digits_split(test_fraction=0.2, seed=0)
    xs, ys = train.tensors
    xt, yt = test.tensors
    assert xs.shape[1:] == (64,) and len(xs) + len(xt) == 1797
    assert float(xs.min()) >= 0.0 and float(xs.max()) <= 1.0
    # every class is held out in about the same share
    counts = torch.bincount(yt, minlength=10).float() / torch.bincount(
        torch.cat([ys, yt]), minlength=10
    )
    assert torch.all((counts - 0.2).abs() < 0.01)
    rows = {tuple(r.tolist()) for r in xt}
    assert sum(tuple(r.tolist()) in rows for r in xs) < 20  # a few digits are duplicates


def test_seed_and_image_shape() -> None:
    a, _ = load_digits_split(seed=1)
    b, _ = load_digits_split(seed=1)
    c, _ = load_digits_split(seed=2)
    assert torch.equal(a.tensors[1], b.tensors[1])
    assert not torch.equal(a.tensors[1], c.tensors[1])
    img, _ = load_digits_split(image=True)
    assert img.tensors[0].shape[1:] == (1, 8, 8)
    with pytest.raises(ValueError, match="test_fraction must be in"):
        load_digits_split(test_fraction=1.0)
