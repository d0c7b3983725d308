"""Model adapters: the one hook through which a model family joins `plait.parallel`.

Everything in `plait.parallel` is model-agnostic except four questions, which an adapter
answers for its model family:

- `dims`: the shape the planner and the validation need (layers, width, heads, ...);
- `blocks`: the repeated blocks (the units of FSDP sharding, activation checkpointing and
  tensor parallelism);
- `block_plan`: how one block is sharded by tensor (and sequence) parallelism, as
  `parallelize_module` styles relative to the block;
- `pipeline_units`: the model as a chain of modules, one tensor in and one out, named by
  their place in the original model so checkpoints keep their keys under any plan.

Adapters ship for plait's GPT, for stock `nn.TransformerEncoder` layers (alone or inside an
`nn.Sequential`) and for plain chains (`nn.Sequential`, plait's MLP: pipelines only).
Another model registers its own in a few lines::

    class MyAdapter(ModelAdapter):
        def dims(self, model): ...
        def blocks(self, model): return [f"layers.{i}" for i in range(len(model.layers))]
        def block_plan(self, block, *, sequence_parallel): return {"fc1": ColwiseParallel(), ...}

    register_adapter(MyModel, MyAdapter())

Models without an adapter get one derived from their structure where they have a stack of
repeated blocks (`plait.parallel.derive`), and otherwise still get data parallelism and ZeRO
(the fallback adapter has no blocks, no tensor plan and no pipeline split); which one a
model gets is `plait.parallel.resolve.adapter_for`'s choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from plait.models import gpt_parallel
from plait.models.gpt import GPT
from plait.models.mlp import MLP

Unit = tuple[str, nn.Module]


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The shape of a model as the planner and plan validation see it.

    Attributes:
        layers: repeated blocks (the finest pipeline split).
        hidden: model width.
        heads: attention heads per block (0: no attention).
        ffn: width of the block's MLP.
        params: parameters of the whole model.
        block_params: parameters of one block.
        seq_len: training sequence length, 0 when unknown.
        vocab: vocabulary size (0: not a language model).
        kv_heads: key/value heads when fewer than `heads` (grouped-query attention; 0:
            as many as `heads`).
        where: the first block, named in errors (``"model.layers.0 (LlamaDecoderLayer)"``).
        no_sequence: why sequence parallelism cannot shard this model ("" if it can).
        block_sizes: parameters of each block when they differ (a stack of layers of
            several widths); empty when every block has `block_params`.
        model: the model's class name, named in errors.
        largest_param: elements of the largest parameter tensor. The optimizer's update of
            one tensor and a gradient before it is accumulated are transients of this size,
            and on models of few large tensors (the MLP's 4 M-element layer) they set the
            peak (`plait.parallel.memory`).
        no_pipeline: why a pipeline cannot split the model ("" if it can): no split of
            its modules into stages, or a parameter registered under two names, which
            stages cannot share. The planner proposes no pipeline for such a model.
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    params: int
    block_params: int
    seq_len: int = 0
    vocab: int = 0
    kv_heads: int = 0
    where: str = ""
    no_sequence: str = ""
    block_sizes: tuple[int, ...] = ()
    model: str = ""
    largest_param: int = 0
    no_pipeline: str = ""

    @property
    def other_params(self) -> int:
        """Parameters outside the blocks (embeddings, final norm, head)."""
        in_blocks = sum(self.block_sizes) if self.block_sizes else self.layers * self.block_params
        return max(0, self.params - in_blocks)

    def stage_blocks(self, n_stages: int) -> list[list[int]]:
        """Parameters of each block of each of `n_stages` pipeline stages, split as
        `plait.parallel.pipeline.split_units` splits the blocks (block i to stage
        ``i * n_stages // layers``); no blocks, empty stages."""
        sizes = self.block_sizes or (self.block_params,) * self.layers
        out: list[list[int]] = [[] for _ in range(n_stages)]
        for i, size in enumerate(sizes):
            out[i * n_stages // len(sizes)].append(size)
        return out

    def check_tensor_degree(self, tp: int, *, sequence: bool = False) -> None:
        """Raise ValueError unless `tp` divides every dimension tensor parallelism shards."""
        if tp == 1:
            return
        if self.layers == 0 or self.hidden == 0:
            raise ValueError(
                "plan: tp > 1 but the model has no tensor-parallel plan; register a "
                "ModelAdapter for it (plait.parallel.register_adapter)"
            )
        dims = (
            ("heads", self.heads),
            ("key/value heads", self.kv_heads),
            ("hidden", self.hidden),
            ("ffn", self.ffn),
        )
        for name, value in dims:
            if value and value % tp:
                where = f" of {self.where}" if self.where else ""
                raise ValueError(
                    f"plan: tensor degree tp={tp} does not divide {name}={value}{where}"
                )
        if sequence and self.no_sequence:
            raise ValueError(f"plan: {self.no_sequence}")
        if sequence and self.seq_len and self.seq_len % tp:
            raise ValueError(
                f"plan: sequence parallelism with tp={tp} needs the sequence length "
                f"({self.seq_len}) divisible by tp"
            )


class ModelAdapter:
    """How `plait.parallel` splits one model family (see the module docstring)."""

    def prepare(self, model: nn.Module) -> None:
        """In-place conversions every plan applies first (so all plans share state keys)."""

    def dims(self, model: nn.Module) -> ModelDims:
        n = count_params(model)
        return ModelDims(
            layers=0, hidden=0, heads=0, ffn=0, params=n, block_params=0,
            model=type(model).__name__, largest_param=largest_param(model),
            no_pipeline=pipeline_obstacle(self, model),
        )  # fmt: skip

    def blocks(self, model: nn.Module) -> list[str]:
        """Qualified names of the repeated blocks, in forward order."""
        return []

    def block_plan(self, block: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        """Tensor-parallel styles for one block, keyed by names relative to the block.

        With `sequence_parallel` the block takes and returns activations sharded along
        `sequence_dim` (local tensors) and norms run on sequence shards.
        """
        raise ValueError(f"{type(self).__name__} has no tensor-parallel plan")

    def sequence_dim(self, model: nn.Module) -> int:
        return 1

    def pipeline_units(self, model: nn.Module) -> list[Unit]:
        """The model as a chain ``x -> unit_0 -> unit_1 -> ...`` of one-tensor modules.

        Each unit is named by its qualified name in `model` ("" for a wrapper module whose
        attributes carry the original top-level names).
        """
        raise ValueError(
            f"{type(model).__name__} has no pipeline split; register a ModelAdapter with "
            "pipeline_units (plait.parallel.register_adapter)"
        )


# ------------------------------------------------------------------------ registry
_ADAPTERS: dict[type[nn.Module], ModelAdapter] = {}


def register_adapter(
    model_type: type[nn.Module], adapter: ModelAdapter | None = None
) -> Callable[[type[ModelAdapter]], type[ModelAdapter]] | None:
    """Use `adapter` for `model_type` and its subclasses (also usable as a class decorator)."""
    if adapter is not None:
        _ADAPTERS[model_type] = adapter
        return None

    def deco(cls: type[ModelAdapter]) -> type[ModelAdapter]:
        _ADAPTERS[model_type] = cls()
        return cls

    return deco


def registered_adapter(model: nn.Module) -> ModelAdapter | None:
    """The adapter registered for the most specific class of `model`, if any (what a
    model gets when none is: `plait.parallel.resolve.adapter_for`)."""
    for cls in type(model).__mro__:
        if cls in _ADAPTERS:
            return _ADAPTERS[cls]
    return None


class BoundUnit(nn.Module):
    """A pipeline unit that calls `fn(x)` and registers `targets` under their own names.

    Blocks of models nobody here wrote take more than one tensor (position embeddings,
    masks); a bound unit supplies the rest while the block itself stays registered under
    its qualified name in the stage, so state-dict keys do not change. `targets` are held
    outside the module tree (the stage registers them).
    """

    def __init__(self, targets: dict[str, nn.Module], fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.targets = dict(targets)  # a plain dict: not registered here
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def count_params(module: nn.Module) -> int:
    """Elements of every parameter of `module`."""
    return sum(p.numel() for p in module.parameters())


def largest_param(module: nn.Module) -> int:
    """Elements of `module`'s largest parameter tensor (`ModelDims.largest_param`)."""
    return max((p.numel() for p in module.parameters()), default=0)


def pipeline_obstacle(adapter: ModelAdapter, model: nn.Module) -> str:
    """Why a pipeline cannot split `model` ("" if it can): tied parameters (the first
    parameter registered under two names) or no split into stages."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            return f"{first[id(p)]} is tied to {name}"
        first[id(p)] = name
    try:
        adapter.pipeline_units(model)
    except ValueError as e:
        return str(e)
    return ""


def _megatron_mlp_attention(
    *,
    q: str,
    k: str,
    v: str,
    o: str,
    fc: str,
    proj: str,
    seq_dim: int,
    sequence_parallel: bool,
) -> dict[str, ParallelStyle]:
    """Column-parallel q/k/v and fc, row-parallel o and proj (each rank a subset of heads)."""
    plan: dict[str, ParallelStyle] = {
        q: ColwiseParallel(),
        k: ColwiseParallel(),
        v: ColwiseParallel(),
    }
    if not sequence_parallel:
        plan.update({o: RowwiseParallel(), fc: ColwiseParallel(), proj: RowwiseParallel()})
        return plan
    plan.update(
        {
            o: RowwiseParallel(output_layouts=Shard(seq_dim)),
            fc: ColwiseParallel(),
            proj: RowwiseParallel(output_layouts=Shard(seq_dim)),
        }
    )
    return plan


# ---------------------------------------------------------------------------- GPT
class GPTAdapter(ModelAdapter):
    """plait's GPT: its plan lives beside the model (`plait.models.gpt_parallel`)."""

    def dims(self, model: nn.Module) -> ModelDims:
        assert isinstance(model, GPT)
        cfg = model.cfg
        return ModelDims(
            layers=cfg.n_layer,
            hidden=cfg.n_embd,
            heads=cfg.n_head,
            ffn=4 * cfg.n_embd,  # the GPT's MLP width
            params=count_params(model),
            block_params=count_params(model.blocks[0]),
            seq_len=cfg.block_size,
            vocab=cfg.vocab_size,
            where="blocks.0 (Block)",
            largest_param=largest_param(model),
            no_pipeline=pipeline_obstacle(self, model),
        )

    def blocks(self, model: nn.Module) -> list[str]:
        assert isinstance(model, GPT)
        return gpt_parallel.block_names(model)

    def block_plan(self, block: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        return gpt_parallel.block_tensor_plan(sequence_parallel=sequence_parallel)

    def pipeline_units(self, model: nn.Module) -> list[Unit]:
        assert isinstance(model, GPT)
        return gpt_parallel.pipeline_units(model)


register_adapter(GPT, GPTAdapter())


# ------------------------------------------------------- nn.TransformerEncoder layers
class HeadParallelAttention(nn.Module):
    """Multi-head attention with separate q/k/v projections, as tensor parallelism needs.

    `nn.MultiheadAttention` packs q, k and v into one ``in_proj_weight``, which a column
    split would cut across the three; this module holds them apart and derives its head
    count from the projection width at run time, so a shard runs its subset of heads. It
    accepts `nn.MultiheadAttention`'s call signature (masks, `is_causal`, `batch_first`)
    and returns ``(output, None)``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = False,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide embed_dim={embed_dim}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention) -> HeadParallelAttention:
        """Same weights as `mha` (same outputs), q/k/v unpacked."""
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(
                "only self-attention style nn.MultiheadAttention (no kdim/vdim, bias_k or "
                "add_zero_attn) converts to a tensor-parallel attention"
            )
        bias = mha.in_proj_bias is not None
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            dropout=mha.dropout,
            bias=bias,
            batch_first=mha.batch_first,
        )
        with torch.no_grad():
            for proj, w in zip(
                (new.q_proj, new.k_proj, new.v_proj), mha.in_proj_weight.chunk(3), strict=True
            ):
                proj.weight.copy_(w)
            if bias:
                assert mha.in_proj_bias is not None
                for proj, b in zip(
                    (new.q_proj, new.k_proj, new.v_proj), mha.in_proj_bias.chunk(3), strict=True
                ):
                    proj.bias.copy_(b)
        new.out_proj = mha.out_proj  # keeps the key "out_proj.*" of the stock module
        return new.to(mha.in_proj_weight.device)

    def forward(  # noqa: PLR0917 - nn.MultiheadAttention's positional signature
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, t, _ = query.shape
        s = key.shape[1]

        def heads(y: torch.Tensor, n: int) -> torch.Tensor:
            return y.view(b, n, -1, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj(query), t)
        k = heads(self.k_proj(key), s)
        v = heads(self.v_proj(value), s)
        mask = _merge_masks(attn_mask, key_padding_mask, q.dtype)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal and mask is None
        )
        out = self.out_proj(y.transpose(1, 2).reshape(b, t, -1))
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, None


def _merge_masks(
    attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """One additive mask from MHA's boolean/float masks (True means "do not attend")."""

    def additive(m: torch.Tensor) -> torch.Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, -math.inf)
        return m.to(dtype)

    mask = None if attn_mask is None else additive(attn_mask)
    if key_padding_mask is not None:
        kpm = additive(key_padding_mask)[:, None, None, :]
        mask = kpm if mask is None else mask + kpm
    return mask


class SequentialAdapter(ModelAdapter):
    """Chains of modules: `nn.Sequential` (or a model keeping one as ``net``, like plait's
    MLP) and `nn.TransformerEncoder`, with stock `nn.TransformerEncoderLayer`s as blocks.

    `prepare` swaps every encoder layer's `nn.MultiheadAttention` for a
    `HeadParallelAttention` holding the same weights, so q, k and v shard by heads.
    Chains without encoder layers pipeline by their children (no tensor plan).
    """

    @staticmethod
    def _chain(model: nn.Module) -> tuple[str, nn.Module]:
        net = getattr(model, "net", None)
        if not isinstance(model, (nn.Sequential, nn.TransformerEncoder)) and isinstance(
            net, nn.Sequential
        ):
            return "net.", net
        return "", model

    def _layers(self, model: nn.Module) -> list[tuple[str, nn.TransformerEncoderLayer]]:
        return [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, nn.TransformerEncoderLayer)
        ]

    def prepare(self, model: nn.Module) -> None:
        for _, layer in self._layers(model):
            if isinstance(layer.self_attn, nn.MultiheadAttention):
                layer.self_attn = HeadParallelAttention.from_mha(layer.self_attn)  # type: ignore[assignment]

    def dims(self, model: nn.Module) -> ModelDims:
        layers = self._layers(model)
        if not layers:
            blocks = [model.get_submodule(b) for b in self.blocks(model)]
            return ModelDims(
                layers=len(blocks),
                hidden=0,
                heads=0,
                ffn=0,
                params=count_params(model),
                block_params=max((count_params(b) for b in blocks), default=0),
                block_sizes=tuple(count_params(b) for b in blocks),
                model=type(model).__name__,
                largest_param=largest_param(model),
                no_pipeline=pipeline_obstacle(self, model),
            )
        first = layers[0][1]
        return ModelDims(
            layers=len(layers),
            hidden=first.linear1.in_features,
            heads=first.self_attn.num_heads,
            ffn=first.linear1.out_features,
            params=count_params(model),
            block_params=count_params(first),
            largest_param=largest_param(model),
            no_pipeline=pipeline_obstacle(self, model),
        )

    def blocks(self, model: nn.Module) -> list[str]:
        layers = self._layers(model)
        if layers:
            return [name for name, _ in layers]
        return [name for name, m in self.pipeline_units(model) if count_params(m)]

    def sequence_dim(self, model: nn.Module) -> int:
        layers = self._layers(model)
        return 1 if not layers or layers[0][1].self_attn.batch_first else 0

    def block_plan(self, block: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        if not isinstance(block, nn.TransformerEncoderLayer):
            return super().block_plan(block, sequence_parallel=sequence_parallel)
        sd = 1 if block.self_attn.batch_first else 0
        plan = _megatron_mlp_attention(
            q="self_attn.q_proj",
            k="self_attn.k_proj",
            v="self_attn.v_proj",
            o="self_attn.out_proj",
            fc="linear1",
            proj="linear2",
            seq_dim=sd,
            sequence_parallel=sequence_parallel,
        )
        if sequence_parallel:
            plan.update(
                {
                    "norm1": SequenceParallel(sequence_dim=sd, use_local_output=True),
                    "norm2": SequenceParallel(sequence_dim=sd, use_local_output=True),
                    "self_attn": PrepareModuleInput(
                        input_layouts=(Shard(sd),) * 3, desired_input_layouts=(Replicate(),) * 3
                    ),
                    "linear1": ColwiseParallel(input_layouts=Shard(sd)),
                }
            )
        return plan

    def pipeline_units(self, model: nn.Module) -> list[Unit]:
        prefix, chain = self._chain(model)
        if isinstance(chain, nn.TransformerEncoder):
            return _encoder_units(chain, prefix)
        if isinstance(chain, nn.Sequential):
            units: list[Unit] = []
            for name, child in chain.named_children():
                if isinstance(child, nn.TransformerEncoder):
                    units += _encoder_units(child, f"{prefix}{name}.")
                else:
                    units.append((f"{prefix}{name}", child))
            return units
        return super().pipeline_units(model)


def _encoder_units(enc: nn.TransformerEncoder, prefix: str) -> list[Unit]:
    units: list[Unit] = [(f"{prefix}layers.{i}", m) for i, m in enumerate(enc.layers)]
    if enc.norm is not None:
        units.append((f"{prefix}norm", enc.norm))
    return units


for _chain_type in (nn.TransformerEncoder, nn.Sequential, MLP):
    register_adapter(_chain_type, SequentialAdapter())


def describe_units(units: list[Unit]) -> list[str]:
    """Readable names of pipeline units (for errors and plan tables)."""
    return [name or type(m).__name__ for name, m in units]
