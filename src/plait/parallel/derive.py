"""Parallel plans derived from a model's structure, for models nobody here wrote.

A model of no registered adapter class still gets tensor, sequence and pipeline
parallelism when its structure says how:

- the *block stack* is the repeated run of same-class children (of an `nn.ModuleList` or
  `nn.Sequential`) holding the most parameters: ``model.layers`` of a Llama,
  ``transformer.h`` of a GPT-2, ``bert.encoder.layer`` of a BERT, the blocks of an MLP;
- a block's *tensor plan* comes from the model's configuration where it carries one
  (`transformers`' ``base_model_tp_plan``: ``colwise``/``rowwise`` per module path),
  otherwise from the names and shapes of its linear layers: the known projection layouts
  (separate or fused q/k/v with an output projection; gate/up/down, fc1/fc2, c_fc/c_proj,
  intermediate/output MLPs) and, for a plain MLP block, two linear layers in a row;
- the *shape* (heads, key/value heads, widths, vocabulary) comes from the configuration
  or the layers themselves;
- the *pipeline chain* (embedding, blocks, head as one-tensor units) is known for the
  standard decoder and encoder layouts of `transformers` (Llama-style, GPT-2-style, BERT).

`transformers`' `Conv1D` layers (GPT-2 family; weight stored ``[in, out]``) become
`nn.Linear` layers holding the same numbers transposed, and a fused q/k/v projection is
split by `FusedColwiseParallel` so that each rank holds its heads of q, of k and of v.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from plait import comm
from plait.parallel.adapters import (
    BoundUnit,
    ModelAdapter,
    ModelDims,
    Unit,
    count_params,
    largest_param,
    pipeline_obstacle,
)

logger = logging.getLogger(__name__)

#: Column groups and the row-parallel layer that closes them, by names relative to a
#: block. A fused projection is written ``name*3`` (q, k and v stacked in one layer).
KNOWN_LAYOUTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.o_proj"),
    (("attn.q_proj", "attn.k_proj", "attn.v_proj"), "attn.o_proj"),
    (
        ("attention.self.query", "attention.self.key", "attention.self.value"),
        "attention.output.dense",
    ),
    (("attn.c_attn*3",), "attn.c_proj"),
    (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
    (("mlp.c_fc",), "mlp.c_proj"),
    (("mlp.fc1",), "mlp.fc2"),
    (("mlp.fc",), "mlp.proj"),
    (("intermediate.dense",), "output.dense"),
    (("fc1",), "fc2"),
    (("linear1",), "linear2"),
)  # fmt: skip - one layout per line reads as the table it is

#: Norms of a block that sequence parallelism runs on sequence shards.
NORM_NAMES = (
    "input_layernorm",
    "post_attention_layernorm",
    "ln_1",
    "ln_2",
    "ln1",
    "ln2",
    "norm1",
    "norm2",
)
#: The sub-modules whose input sequence parallelism gathers (the start of a column split).
SUBLAYER_NAMES = ("self_attn", "attn", "mlp")


def _linear_like(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or _is_conv1d(m)


def _is_conv1d(m: nn.Module) -> bool:
    """`transformers.pytorch_utils.Conv1D` without importing transformers."""
    return type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None


# --------------------------------------------------------------------- block stack
def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's block stack (see the module docstring); [] if none."""
    best: list[str] = []
    best_params = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        runs: list[list[tuple[str, nn.Module]]] = []
        for child_name, child in module.named_children():
            if runs and type(runs[-1][-1][1]) is type(child):
                runs[-1].append((child_name, child))
            else:
                runs.append([(child_name, child)])
        for run in runs:
            if len(run) < 2 or not any(_linear_like(m) for _, m in run[0][1].named_modules()):
                continue
            params = sum(count_params(m) for _, m in run)
            if params > best_params:
                prefix = f"{name}." if name else ""
                best, best_params = [f"{prefix}{c}" for c, _ in run], params
    return best


# ------------------------------------------------------------------ tensor plans
def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def config_block_plan(model: nn.Module, first_block: str) -> dict[str, str] | None:
    """``{name relative to a block: "colwise" | "rowwise"}`` from the model's config.

    `transformers` configs carry ``base_model_tp_plan`` keyed by paths below the base
    model (``layers.*.self_attn.q_proj``); entries of the blocks are kept. None when the
    config has no plan or uses a style plait does not map (packed or gathered outputs).
    """
    plan = getattr(_config(model), "base_model_tp_plan", None)
    if not plan:
        return None
    stack = first_block.rsplit(".", 1)[0]
    out: dict[str, str] = {}
    for key, style in plan.items():
        if "*." not in key:
            continue
        head, _, rel = key.partition("*.")
        if not (stack + ".").endswith(head):
            continue
        if style not in ("colwise", "rowwise"):
            logger.info("config tensor plan: style %r of %s is not mapped", style, key)
            return None
        out[rel] = style
    return out or None


def structural_block_plan(block: nn.Module) -> dict[str, str]:
    """``{relative name: "colwise" | "rowwise" | "colwise*3"}`` from the block's layers."""
    names = {n for n, m in block.named_modules() if _linear_like(m)}
    out: dict[str, str] = {}
    for cols, row in KNOWN_LAYOUTS:
        bare = [c.removesuffix("*3") for c in cols]
        if row in names and all(b in names for b in bare) and not ({row, *bare} & out.keys()):
            for c, b in zip(cols, bare, strict=True):
                out[b] = "colwise*3" if c.endswith("*3") else "colwise"
            out[row] = "rowwise"
    if out:
        return out
    linears = [(n, m) for n, m in block.named_modules() if _linear_like(m)]
    if len(linears) == 2:  # a plain MLP block: widen, then narrow
        (a, ma), (b, mb) = linears
        if _out_features(ma) == _in_features(mb):
            return {a: "colwise", b: "rowwise"}
    return {}


def _weight_shape(m: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear-like layer (`Conv1D` stores ``[in, out]``, Linear the reverse)."""
    w = m.weight
    assert isinstance(w, torch.Tensor)
    rows, cols = int(w.shape[0]), int(w.shape[1])
    return (rows, cols) if _is_conv1d(m) else (cols, rows)


def _in_features(m: nn.Module) -> int:
    return _weight_shape(m)[0]


def _out_features(m: nn.Module) -> int:
    return _weight_shape(m)[1]


class FusedColwiseParallel(ParallelStyle):
    """Column parallelism of a layer whose output stacks `parts` projections (fused q/k/v).

    A plain column split of ``[q; k; v]`` would give rank 0 all of q and half of k. Here
    each rank holds its slice of every part (its heads of q, of k and of v), recorded as a
    strided shard so that the full tensor (checkpoints, `full_tensor`) is the original
    one. The layer runs on local tensors: its input gradient is summed over the tensor
    axis in backward, as a column split needs.
    """

    def __init__(self, parts: int = 3) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Linear), "fused projections are converted to nn.Linear"
        n, r = device_mesh.size(), device_mesh.get_local_rank()
        placement = [_StridedShard(0, split_factor=self.parts)]
        for name in ("weight", "bias"):
            p = getattr(module, name)
            if p is None:
                continue
            pieces = p.detach().chunk(self.parts, dim=0)
            local = torch.cat([piece.chunk(n, dim=0)[r] for piece in pieces]).contiguous()
            dt = DTensor.from_local(local, device_mesh, placement, run_check=False)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        group = device_mesh.get_group()

        def forward(x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor):
                x = x.to_local()
            x = _SumGradOverGroup.apply(x, group)
            w = _local(module.weight)
            b = _local(module.bias) if module.bias is not None else None
            return F.linear(x, w, b)

        module.forward = forward  # type: ignore[assignment]
        return module


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (a column split's input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group, name="tp input grad", async_op=False)
        return grad, None


class _GatherSequence(ParallelStyle):
    """Gather the sequence of a sub-layer's hidden-state input (positional or keyword)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DTensor):
                t = t.to_local()
            d = DTensor.from_local(t, device_mesh, [Shard(self.dim)], run_check=False)
            return d.redistribute(device_mesh, [Replicate()]).to_local()

        def hook(
            _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args and isinstance(args[0], torch.Tensor):
                args = (gather(args[0]), *args[1:])
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                kwargs = {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def to_styles(
    plan: dict[str, str], *, sequence_parallel: bool, block: nn.Module, seq_dim: int = 1
) -> dict[str, ParallelStyle]:
    """Torch styles for a block plan of ``colwise``/``rowwise``/``colwise*3`` names."""
    out: dict[str, ParallelStyle] = {}
    for name, kind in plan.items():
        if kind == "colwise*3":
            out[name] = FusedColwiseParallel(3)
        elif kind == "colwise":
            out[name] = ColwiseParallel()
        elif sequence_parallel:
            out[name] = RowwiseParallel(output_layouts=Shard(seq_dim))
        else:
            out[name] = RowwiseParallel()
    fused_parents = {n.rpartition(".")[0] for n, k in plan.items() if k == "colwise*3"}
    for parent in fused_parents:  # its split of the fused output shrinks with the shard
        out[parent] = _ShardAttributes(("split_size",))
    if sequence_parallel:
        children = dict(block.named_children())
        why = sequence_obstacle(block)
        if why:
            raise ValueError(why)
        for norm in NORM_NAMES:
            if norm in children:
                out[norm] = SequenceParallel(sequence_dim=seq_dim, use_local_output=True)
        for sub in SUBLAYER_NAMES:
            if sub in children and any(k.startswith(f"{sub}.") for k in plan):
                gather = _GatherSequence(seq_dim)
                out[sub] = _Chain(out[sub], gather) if sub in out else gather
    return out


def sequence_obstacle(block: nn.Module) -> str:
    """Why sequence parallelism cannot shard `block` ("" when it can).

    Norms inside a sub-layer (BERT's post-norm ``attention.output.LayerNorm``) run on
    the residual sum the sub-layer computes itself; plait shards the norms that are
    children of the block (pre-norm decoders).
    """
    nested = [
        n for n, m in block.named_modules() if "Norm" in type(m).__name__ and n not in NORM_NAMES
    ]
    if not nested:
        return ""
    return (
        f"sequence parallelism: {type(block).__name__} has norms inside its sub-layers "
        f"({', '.join(nested)}); plait shards norms that are children of the block only "
        "(pre-norm decoders)"
    )


class _ShardAttributes(ParallelStyle):
    """Divide integer attributes of a module by the tensor degree (widths it splits by)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        n = device_mesh.size()
        for name in self.names:
            value = getattr(module, name, None)
            if isinstance(value, int):
                if value % n:
                    raise ValueError(
                        f"tensor degree {n} does not divide {type(module).__name__}.{name}={value}"
                    )
                setattr(module, name, value // n)
        return module


class _Chain(ParallelStyle):
    """Several styles applied to one module in turn."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


# ------------------------------------------------------------------- pipelines
def _decoder_units(model: nn.Module) -> list[Unit] | None:
    """Llama-style: ``model.{embed_tokens, layers, norm, rotary_emb}`` and ``lm_head``."""
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, p) for p in parts) or not hasattr(model, "lm_head"):
        return None
    rotary = base.rotary_emb

    def call(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(x.shape[1], device=x.device)[None]
            return layer(x, position_ids=pos, position_embeddings=rotary(x, pos))  # type: ignore[no-any-return]

        return fn

    units: list[Unit] = [("model.embed_tokens", base.embed_tokens)]
    for i, layer in enumerate(base.layers):
        name = f"model.layers.{i}"
        units.append((name, BoundUnit({name: layer}, call(layer))))
    return [*units, ("model.norm", base.norm), ("lm_head", model.lm_head)]


def _gpt2_units(model: nn.Module) -> list[Unit] | None:
    """GPT-2-style: ``transformer.{wte, wpe, drop, h, ln_f}`` and ``lm_head``."""
    base = getattr(model, "transformer", None)
    parts = ("wte", "wpe", "drop", "h", "ln_f")
    if base is None or not all(hasattr(base, p) for p in parts) or not hasattr(model, "lm_head"):
        return None

    def embed(x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        return base.drop(base.wte(x) + base.wpe(pos))  # type: ignore[no-any-return]

    targets = {f"transformer.{p}": getattr(base, p) for p in ("wte", "wpe", "drop")}
    units: list[Unit] = [("", BoundUnit(targets, embed))]
    units += [(f"transformer.h.{i}", b) for i, b in enumerate(base.h)]
    return [*units, ("transformer.ln_f", base.ln_f), ("lm_head", model.lm_head)]


def _bert_units(model: nn.Module) -> list[Unit] | None:
    """BERT-style: ``bert.{embeddings, encoder.layer}`` and a ``cls`` head."""
    base = getattr(model, "bert", None)
    if base is None or not hasattr(model, "cls") or getattr(base, "pooler", None) is not None:
        return None
    emb = base.embeddings
    units: list[Unit] = [
        ("bert.embeddings", BoundUnit({"bert.embeddings": emb}, lambda x: emb(input_ids=x)))
    ]
    units += [(f"bert.encoder.layer.{i}", b) for i, b in enumerate(base.encoder.layer)]
    head = model.cls
    assert isinstance(head, nn.Module)
    return [*units, ("cls", head)]


# ---------------------------------------------------------------------- adapter
class DerivedAdapter(ModelAdapter):
    """The adapter of a model whose plan is derived from its structure (module docstring)."""

    def __init__(self, blocks: list[str], config_plan: dict[str, str] | None = None) -> None:
        self._blocks = blocks
        self._config_plan = config_plan

    def prepare(self, model: nn.Module) -> None:
        """`Conv1D` layers of the blocks become `nn.Linear` (same numbers, transposed);
        caches off (training does not use them)."""
        for b in self._blocks:
            block = model.get_submodule(b)
            for name, m in list(block.named_modules()):
                if _is_conv1d(m):
                    _replace(block, name, _linear_from_conv1d(m))
        cfg = _config(model)
        if cfg is not None and getattr(cfg, "use_cache", False):
            cfg.use_cache = False

    def blocks(self, model: nn.Module) -> list[str]:
        return list(self._blocks)

    def _plan(self, block: nn.Module) -> dict[str, str]:
        return self._config_plan or structural_block_plan(block)

    def plan_source(self) -> str:
        """Where the tensor plan comes from, for the planner's explanation."""
        if self._config_plan:
            return "the model config's base_model_tp_plan"
        return "the block's layer structure"

    def dims(self, model: nn.Module) -> ModelDims:
        block = model.get_submodule(self._blocks[0])
        plan = self._plan(block)
        cfg = _config(model)

        def cfg_int(*names: str) -> int:
            for n in names:
                v = getattr(cfg, n, None)
                if isinstance(v, int) and not isinstance(v, bool):
                    return v
            return 0

        cols = [block.get_submodule(n) for n, k in plan.items() if k.startswith("colwise")]
        hidden = cfg_int("hidden_size", "n_embd", "d_model") or (
            _in_features(cols[0]) if cols else 0
        )
        ffn = cfg_int("intermediate_size", "n_inner") or (
            max(_out_features(c) for c in cols) if cols else 0
        )
        heads = cfg_int("num_attention_heads", "n_head")
        kv = cfg_int("num_key_value_heads")
        return ModelDims(
            layers=len(self._blocks) if plan else 0,
            hidden=hidden if plan else 0,
            heads=heads,
            kv_heads=kv if kv != heads else 0,
            ffn=ffn,
            params=count_params(model),
            block_params=count_params(block),
            seq_len=0,
            vocab=cfg_int("vocab_size"),
            where=f"{self._blocks[0]} ({type(block).__name__})",
            no_sequence=sequence_obstacle(block),
            largest_param=largest_param(model),
            no_pipeline=pipeline_obstacle(self, model),
        )

    def block_plan(self, block: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
        plan = self._plan(block)
        if not plan:
            raise ValueError(
                f"no tensor-parallel plan derives from {type(block).__name__}: register a "
                "ModelAdapter (plait.parallel.register_adapter)"
            )
        return to_styles(plan, sequence_parallel=sequence_parallel, block=block)

    def pipeline_units(self, model: nn.Module) -> list[Unit]:
        for derive in (_decoder_units, _gpt2_units, _bert_units):
            units = derive(model)
            if units is not None:
                return units
        if isinstance(model, nn.Sequential):
            return [(n, m) for n, m in model.named_children()]
        return super().pipeline_units(model)


def derived_adapter(model: nn.Module) -> DerivedAdapter | None:
    """A `DerivedAdapter` for `model` if it has a block stack, else None."""
    blocks = find_blocks(model)
    if not blocks:
        return None
    return DerivedAdapter(blocks, config_block_plan(model, blocks[0]))


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def _linear_from_conv1d(conv: nn.Module) -> nn.Linear:
    w, bias = conv.weight, conv.bias
    assert isinstance(w, torch.Tensor)
    lin = nn.Linear(w.shape[0], w.shape[1], bias=bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w.t())
        if isinstance(bias, torch.Tensor):
            lin.bias.copy_(bias)
    return lin
