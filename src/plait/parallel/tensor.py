"""Tensor and sequence parallelism of a model's blocks, and activation checkpointing.

Each block is sharded with the styles its adapter gives (`parallelize_module` on the tensor
axis). With sequence parallelism, a run of consecutive blocks takes and returns activations
sharded along the sequence: the first block of the run cuts its (replicated) input, the
last gathers its output, so what lies outside the run (embeddings, head, pipeline sends)
sees ordinary replicated tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module
from torch.utils.checkpoint import checkpoint

from plait.parallel.adapters import ModelAdapter


def apply_tensor_parallel(
    blocks: Sequence[nn.Module],
    *,
    adapter: ModelAdapter,
    mesh: DeviceMesh,
    sequence_parallel: bool,
    sequence_dim: int,
) -> None:
    """Shard consecutive `blocks` in place over the tensor axis `mesh`."""
    for block in blocks:
        parallelize_module(
            block, mesh, adapter.block_plan(block, sequence_parallel=sequence_parallel)
        )
    if sequence_parallel and blocks:
        blocks[0].register_forward_pre_hook(
            _reshard_hidden_input(mesh, Shard(sequence_dim)), with_kwargs=True
        )
        parallelize_module(
            blocks[-1],
            mesh,
            PrepareModuleOutput(
                output_layouts=(Shard(sequence_dim),),
                desired_output_layouts=(Replicate(),),
                use_local_output=True,
            ),
        )


def _reshard_hidden_input(mesh: DeviceMesh, placement: Placement) -> Callable[..., Any]:
    """A forward pre-hook cutting a block's replicated hidden states to `placement`.

    The hidden states are the first positional argument or the ``hidden_states`` keyword
    (how `transformers` blocks are called); other arguments pass unchanged.
    """

    def cut(t: torch.Tensor) -> torch.Tensor:
        d = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return d.redistribute(mesh, [placement]).to_local()

    def hook(
        _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args and isinstance(args[0], torch.Tensor):
            return (cut(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": cut(kwargs["hidden_states"])}
        raise ValueError(
            f"sequence parallelism: {type(_m).__name__} takes no hidden-state tensor first"
        )

    return hook


def checkpoint_activations(blocks: Sequence[nn.Module]) -> None:
    """Recompute each block's activations in backward instead of keeping them.

    The block's own `forward` is replaced (not the module), so parameter names, module
    hooks (tensor-parallel layouts, FSDP) and checkpoints are unchanged.
    """
    for block in blocks:
        inner: Callable[..., Any] = block.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
