"""How plait's GPT splits for parallel training, in torch's own terms.

`plait.parallel` asks a model family four questions (its shape, its repeated blocks, how
a block shards, how the model cuts into a chain of stages). For the GPT of
`plait.models.gpt` the answers live here, beside the model, written with
`torch.distributed.tensor.parallel` styles only: the model package knows nothing of
plait's parallel machinery, which reads these functions.

The plan is Megatron's: q, k, v and the MLP's first layer split by columns (each rank a
subset of heads and hidden units), the attention output and the MLP's second layer by
rows, so one all-reduce (or, with sequence parallelism, one reduce-scatter) ends each
sub-layer.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from plait.models.gpt import GPT


def block_names(model: GPT) -> list[str]:
    """Qualified names of the blocks, in forward order."""
    return [f"blocks.{i}" for i in range(len(model.blocks))]


def block_tensor_plan(*, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Styles for one `Block`, keyed by names relative to the block.

    With `sequence_parallel` the block takes and returns activations sharded along the
    sequence (dimension 1): the norms run on sequence shards, each sub-layer gathers the
    sequence before its column split and reduce-scatters after its row split.
    """
    out = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    plan: dict[str, ParallelStyle] = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": out,
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": (
            RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        ),
    }
    if sequence_parallel:
        for norm in ("ln1", "ln2"):
            plan[norm] = SequenceParallel(use_local_output=True)
        for sub in ("attn", "mlp"):
            plan[sub] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    return plan


class Embed(nn.Module):
    """Token and position embeddings of a GPT, under their original attribute names."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok_emb = gpt.tok_emb
        self.pos_emb = gpt.pos_emb
        self.drop = gpt.drop
        self.block_size = gpt.cfg.block_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # type: ignore[no-any-return]


class Head(nn.Module):
    """Final norm and LM head of a GPT, under their original attribute names."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f = gpt.ln_f
        self.head = gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def pipeline_units(model: GPT) -> list[tuple[str, nn.Module]]:
    """The GPT as a chain of one-tensor modules: embeddings, blocks, head.

    Wrappers are named "" (their attributes carry the model's top-level names), blocks by
    their qualified names, so every stage keeps the model's state-dict keys.
    """
    units: list[tuple[str, nn.Module]] = [("", Embed(model))]
    units += [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    units.append(("", Head(model)))
    return units
