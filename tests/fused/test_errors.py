"""The errors `plait.fuse` raises: ValueErrors that name the culprit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from plait.fused import StructureMismatchError, UnsupportedLayerError


def test_errors_are_value_errors() -> None:
    # user errors in plait are ValueErrors; callers catching those also catch these
    assert issubclass(UnsupportedLayerError, ValueError)
    assert issubclass(StructureMismatchError, ValueError)


def test_unsupported_layer_names_the_layer_and_the_fallback() -> None:
    array = plait.fuse(lambda: nn.Sequential(nn.GRU(3, 4)), n=2)
    with pytest.raises(UnsupportedLayerError, match=r"'0' \(torch.nn.modules.rnn.GRU\).*'vmap'"):
        array(torch.randn(2, 5, 3))


def test_structure_mismatch_names_the_first_difference() -> None:
    with pytest.raises(StructureMismatchError, match="1"):
        plait.fuse([nn.Sequential(nn.Linear(2, 3)), nn.Sequential(nn.Linear(2, 4))])
