"""The largest array that fits in memory: doubling, then bisection.

`largest_fitting(fits, limit)` needs only a yes/no probe. `step_memory` is the probe's
measure on a CPU (no allocator statistics there): the bytes of parameters, gradients and
optimizer state after one real training step, plus the activations autograd saved for
the backward pass, plus the fused optimizer's flat temporaries. On a GPU the probe is
the allocator's own peak, and an out-of-memory error counts as "does not fit".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor


def largest_fitting(fits: Callable[[int], bool], *, limit: int) -> int:
    """The largest n in [1, limit] with fits(n), assuming fits is monotone.

    Doubles n from 1 until a probe fails or `limit` is reached, then bisects between the
    last size that fitted and the first that did not: O(log n) probes.

    Raises:
        ValueError: not even one model fits.
    """
    if limit < 1:
        raise ValueError(f"the array size limit must be >= 1, got {limit}")
    if not fits(1):
        raise ValueError("not even one model fits in the memory budget")
    lo, hi = 1, None
    n = 2
    while n <= limit:
        if not fits(n):
            hi = n
            break
        lo, n = n, n * 2
    if hi is None:
        if lo == limit or fits(limit):
            return limit
        hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def available_memory() -> int:
    """Bytes the kernel says a new allocation can get (MemAvailable), or 4 GiB unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def step_memory(
    step: Callable[[], None], *, params: list[torch.Tensor], state: Callable[[], list[torch.Tensor]]
) -> int:
    """Peak bytes of one training step, measured by running it once.

    Args:
        step: runs forward, backward and the optimizer step.
        params: the parameters (their gradients are counted after the step).
        state: returns the optimizer's state tensors after the step.
    """
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        # a captured array's first step exports the model, whose tracing saves fake
        # tensors (shapes without memory) through these hooks too
        if not isinstance(t, FakeTensor):
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    activations = tensor_bytes(saved)
    weights = tensor_bytes(list(params))
    grads = tensor_bytes([p.grad for p in params if p.grad is not None])
    saved.clear()
    # the fused optimizer's gathered gradients and update temporaries: about 3x the weights
    return weights + grads + tensor_bytes(state()) + activations + 3 * weights
