"""Gradient averaging of local shards: the local part of plain and distributed tensors."""

from __future__ import annotations

import torch

from plait.parallel.gradsync import local_tensor


def test_local_tensor_of_a_plain_tensor_is_itself() -> None:
    t = torch.ones(3)
    assert local_tensor(t) is t
