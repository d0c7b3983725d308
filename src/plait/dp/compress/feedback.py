"""Error-feedback buffers for element-wise compressors (sign, top-k).

A compressor with error feedback keeps, per worker, what compression dropped and adds it
to the next gradient, which makes biased compressors converge. The buffer of a bucket is
one flat tensor shaped like the bucket, so correction is a single add; its storage
belongs to the parameters (by name), so it survives DDP re-bucketing and checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._C._distributed_c10d import GradBucket

from plait.dp.compress.base import Compressor


class BucketErrors:
    """Flat per-bucket error buffers over per-parameter storage."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self._buckets: dict[tuple[int, ...], tuple[list[str], torch.Tensor]] = {}

    def of(
        self, bucket: GradBucket, names: Callable[[Sequence[torch.Tensor]], list[str]]
    ) -> torch.Tensor:
        """The flat error buffer of `bucket`; `names` names its parameters when new."""
        params = bucket.parameters()
        key = tuple(map(id, params))
        hit = self._buckets.get(key)
        if hit is not None:
            return hit[1]
        bucket_names = names(params)
        err = torch.zeros_like(bucket.buffer())
        off = 0
        for name, p in zip(bucket_names, params, strict=True):
            view = err[off : off + p.numel()]
            old = self.params.get(name)
            if old is not None:
                if old.numel() != p.numel():
                    raise ValueError(
                        f"error buffer of {name!r} has {old.numel()} entries, "
                        f"the parameter {p.numel()}"
                    )
                view.copy_(old.reshape(-1))
            self.params[name] = view.view(p.shape)
            off += p.numel()
        mine = set(bucket_names)
        self._buckets = {k: v for k, v in self._buckets.items() if not mine.intersection(v[0])}
        self._buckets[key] = (bucket_names, err)
        return err

    def state_dict(self) -> dict[str, Any]:
        return {name: e.clone() for name, e in self.params.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.params = dict(state)
        self._buckets = {}


class ErrorFeedbackCompressor(Compressor):
    """A compressor whose only state is its error buffers (sign, top-k)."""

    def __init__(self, *, group: Any = None) -> None:
        super().__init__(group=group)
        self.errors = BucketErrors()

    def state_dict(self) -> dict[str, Any]:
        return {"errors": self.errors.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "errors" not in state:
            raise ValueError(f"{self.name} state lacks 'errors'")
        self.errors.load_state_dict(state["errors"])
