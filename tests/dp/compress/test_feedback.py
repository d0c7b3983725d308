"""`plait.dp.compress.feedback`: error buffers live per parameter, so they survive DDP
re-bucketing and checkpoints; no process group needed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from plait.dp.compress.feedback import BucketErrors


@dataclass
class _Bucket:
    """The two methods of DDP's GradBucket that BucketErrors uses."""

    params: list[torch.Tensor]

    def parameters(self) -> list[torch.Tensor]:
        return self.params

    def buffer(self) -> torch.Tensor:
        return torch.zeros(sum(p.numel() for p in self.params))


def _names(params: list[torch.Tensor]) -> list[str]:
    return [NAMES[id(p)] for p in params]


A, B, C = torch.zeros(2, 3), torch.zeros(4), torch.zeros(1)
NAMES = {id(A): "a", id(B): "b", id(C): "c"}


def test_errors_follow_parameters_across_bucket_layouts() -> None:
    errors = BucketErrors()
    first = errors.of(_Bucket([A, B]), _names)  # type: ignore[arg-type]
    first.copy_(torch.arange(10.0))
    assert errors.of(_Bucket([A, B]), _names) is first  # type: ignore[arg-type]
    # DDP rebuilds its buckets in another order: each parameter keeps its own residual
    rebuilt = errors.of(_Bucket([B, C, A]), _names)  # type: ignore[arg-type]
    assert rebuilt.tolist() == [6.0, 7.0, 8.0, 9.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    state = errors.state_dict()
    assert state["b"].tolist() == [6.0, 7.0, 8.0, 9.0] and state["a"].shape == (2, 3)

    resumed = BucketErrors()
    resumed.load_state_dict(state)
    assert resumed.of(_Bucket([A]), _names).tolist() == list(range(6))  # type: ignore[arg-type]


def test_a_residual_of_the_wrong_size_is_refused() -> None:
    errors = BucketErrors()
    errors.load_state_dict({"b": torch.zeros(3)})
    with pytest.raises(ValueError, match="error buffer of 'b' has 3 entries, the parameter 4"):
        errors.of(_Bucket([B]), _names)  # type: ignore[arg-type]
