"""Rewrite one model's exported graph into the graph of a fused array of B models.

`torch.export` lifts a model's parameters, buffers and constants to graph inputs ahead
of the user's inputs, so the exported graph is a pure function of them. The rewrite keeps
that shape: its `FusedGraph` takes the array's stacked [B, ...] parameters and buffers
where the model took its own, the [B, N, ...] inputs where it took [N, ...], and returns
the outputs with B in front. Nothing in it depends on B, so one rewrite serves arrays of
any size and survives `keep()`.

Each operator node is replaced by its batching rule (`rules.RULES`, `layers.LAYER_RULES`);
a node whose arguments are all shared runs unchanged, once for all models. A node
computed from literals alone (the causal and padding masks `transformers` builds from
`arange`, forty operators in a Llama) is evaluated once, here, and its value becomes a
constant of the fused graph; an attention mask so found to hide nothing is dropped, and
one that is the causal mask becomes `is_causal`, which the attention kernels apply
without reading a mask. A node without a rule raises `UnsupportedLayerError` naming it
and the layer it was recorded in.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from plait.fused.capture.layers import LAYER_RULES
from plait.fused.capture.rules import RULES, Call, Flags, find_rule
from plait.fused.errors import UnsupportedLayerError
from plait.fused.rules import any_batched

_TABLE = {**RULES, **LAYER_RULES}
aten = torch.ops.aten


class SlotKind(StrEnum):
    """What the array passes for one input of a fused graph."""

    PARAMETER = "parameter"  # a stacked [B, ...] parameter, by name
    BUFFER = "buffer"  # a stacked [B, ...] buffer, by name
    SHARED_BUFFER = "shared_buffer"  # model 0's copy of a buffer every model holds alike
    CONSTANT = "constant"  # a tensor the export lifted, shared by all models
    INPUT = "input"  # the next leaf of the call's inputs, [B, ...] if a tensor
    SETTING = "setting"  # every model's value of one layer attribute (dropout p)


@dataclass(frozen=True)
class Slot:
    kind: SlotKind
    name: str  # parameter/buffer/constant name; "layer:attribute" for a setting


@dataclass(frozen=True, kw_only=True)
class FusedGraph:
    """A captured forward rewritten for B models (see the module docstring).

    Attributes:
        module: runs the fused forward: one argument per slot, in order.
        slots: what to pass for each argument.
        constants: the lifted constants by name.
        mutated: buffers written through the first outputs (a functional export's
            buffer updates), in order.
        out_spec: how the remaining outputs rebuild the model's output (a tensor, a
            tuple, a `ModelOutput`...).
        out_batched: per output leaf, whether it carries B (shared ones are expanded).
    """

    module: fx.GraphModule
    slots: tuple[Slot, ...]
    constants: Mapping[str, torch.Tensor]
    mutated: tuple[str, ...]
    out_spec: pytree.TreeSpec
    out_batched: tuple[bool, ...]
    settings: tuple[str, ...] = field(default=())


def bind(op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Every argument of an operator call by its schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _layer(node: fx.Node) -> tuple[str, str]:
    """(path, type name) of the innermost module a node was recorded in."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
    return str(path), name


def rewrite(
    ep: ExportedProgram,
    *,
    model: str,
    layers: Mapping[str, nn.Module],
    shared_buffers: frozenset[str] = frozenset(),
) -> FusedGraph:
    """The fused graph of exported program `ep`.

    Args:
        ep: one model's forward, exported on one model's inputs.
        model: the model's class name, for error messages.
        layers: the model's submodules by path (to read per-model settings' layer types).
        shared_buffers: buffers the array may pass once for all models (equal in every
            model and not persistent); any the graph writes to stay per model.

    Raises:
        UnsupportedLayerError: a node has no fused form; the message names it.
    """
    sig = ep.graph_signature
    graph = ep.graph_module.graph
    written = _written_nodes(graph)
    mutated_inputs = {n.name for n in written if n.op == "placeholder"}
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    flags: dict[fx.Node, Flags] = {}
    slots: list[Slot] = []
    settings: dict[str, fx.Node] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(sig.input_specs), "export's signature and graph disagree"
    last: list[fx.Node] = []
    folded = _fold_literals(graph, written)
    constants = dict(ep.constants)
    lifted: dict[fx.Node, fx.Node] = {}

    for node, spec in zip(placeholders, sig.input_specs, strict=True):
        target = spec.target or ""
        if spec.kind is InputKind.PARAMETER:
            slot = Slot(SlotKind.PARAMETER, target)
        elif spec.kind is InputKind.BUFFER:
            shared = target in shared_buffers and node.name not in mutated_inputs
            slot = Slot(SlotKind.SHARED_BUFFER if shared else SlotKind.BUFFER, target)
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            slot = Slot(SlotKind.CONSTANT, target)
        elif spec.kind is InputKind.USER_INPUT:
            slot = Slot(SlotKind.INPUT, node.name)
        else:
            raise UnsupportedLayerError(f"{model}: graph input {node.name} ({spec.kind}) "
                                        "cannot be fused")  # fmt: skip
        slots.append(slot)
        env[node] = new.placeholder(node.name)
        last[:] = [env[node]]
        value = node.meta.get("val")
        flags[node] = slot.kind in (SlotKind.PARAMETER, SlotKind.BUFFER) or (
            slot.kind is SlotKind.INPUT and isinstance(value, torch.Tensor)
        )

    def constant(node: fx.Node) -> fx.Node:
        """The fused graph's input for folded `node`: a constant slot holding its value."""
        if node not in lifted:
            name = f"_folded_{node.name}"
            with new.inserting_after(last[0]):
                lifted[node] = new.placeholder(name)
            last[0] = lifted[node]
            slots.append(Slot(SlotKind.CONSTANT, name))
            constants[name] = folded[node]
            flags[node] = False
        return lifted[node]

    def lookup(x: fx.Node) -> fx.Node:
        return constant(x) if x in folded else env[x]

    def flag(a: Any) -> Flags:
        if isinstance(a, fx.Node):
            return flags[a]
        if isinstance(a, list | tuple):
            return tuple(flag(x) for x in a)
        return False

    def setting(path: str, attr: str) -> fx.Node:
        key = f"{path}:{attr}"
        if key not in settings:
            with new.inserting_after(last[0]):
                settings[key] = new.placeholder(f"setting_{len(settings)}")
            last[0] = settings[key]
            slots.append(Slot(SlotKind.SETTING, key))
        return settings[key]

    for node in graph.nodes:
        if node.op == "placeholder" or node in folded or _folded_assert(node, folded):
            continue
        if node.op == "output":
            outs = node.args[0]
            env[node] = new.output(fx.node.map_arg(outs, lookup))
            out_flags = [any_batched(flag(o)) for o in outs]
            continue
        path, kind = _layer(node)
        place = f"layer '{path}' ({kind})" if path else f"{model}.forward"
        where = f"{model}: node '{node.name}' ({node.target}) in {place}"
        if node.op != "call_function":
            raise UnsupportedLayerError(f"{where} cannot be fused ({node.op})")
        if node.target is operator.getitem:
            env[node] = new.node_copy(node, lookup)
            container, idx = flag(node.args[0]), node.args[1]
            flags[node] = container[idx] if isinstance(container, tuple) else container
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            raise UnsupportedLayerError(
                f"{where} cannot be fused: only ATen operators have batching rules"
            )
        args = bind(node.target, node.args, node.kwargs)
        if node.target is aten.scaled_dot_product_attention.default:
            args = _known_mask(args, folded)
        for a in pytree.tree_leaves(args):
            if isinstance(a, fx.Node) and a in folded:
                constant(a)
        arg_flags = {k: flag(v) for k, v in args.items()}
        if not any(any_batched(f) for f in arg_flags.values()):
            env[node] = new.node_copy(node, lookup)
            flags[node] = False
            continue
        rule = find_rule(node.target, _TABLE)
        if rule is None:
            raise UnsupportedLayerError(f"{where} cannot be fused: it has no batching rule")
        out = rule(Call(op=node.target, args=args, flags=arg_flags, where=where, layer=path))
        kwargs = {k: fx.node.map_arg(v, lookup) for k, v in args.items()}
        layer = layers.get(path)
        for keyword, (layer_type, attr) in out.settings.items():
            if isinstance(layer, layer_type):
                kwargs[keyword] = setting(path, attr)
        env[node] = new.call_function(out.impl, (), kwargs)
        env[node].meta["source"] = where
        flags[node] = out.batched

    mutated = tuple(
        s.target or "" for s in sig.output_specs if s.kind is OutputKind.BUFFER_MUTATION
    )
    if any(s.kind not in (OutputKind.BUFFER_MUTATION, OutputKind.USER_OUTPUT)
           for s in sig.output_specs):  # fmt: skip
        raise UnsupportedLayerError(f"{model}: its graph mutates inputs or parameters")
    module = fx.GraphModule(nn.Module(), new, class_name=f"Fused{model}")
    return FusedGraph(
        module=module,
        slots=tuple(slots),
        constants=constants,
        mutated=mutated,
        out_spec=ep.call_spec.out_spec,
        out_batched=tuple(out_flags[len(mutated) :]),
        settings=tuple(settings),
    )


def _fold_literals(graph: fx.Graph, written: set[fx.Node]) -> dict[fx.Node, torch.Tensor]:
    """The value of every node computed from literals alone (no graph input, nothing
    random), for the nodes that are tensors: one model's masks and positions. A node some
    operator writes in place (`written`), and everything it was computed from (a view's
    base), stays in the graph: its value is not the same at every use."""
    written = set(written)
    stack = list(written)
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in written:
                written.add(a)
                stack.append(a)
    values: dict[fx.Node, Any] = {}
    for node in graph.nodes:
        if node in written:
            continue
        target = node.target
        if node.op != "call_function" or not (
            isinstance(target, torch._ops.OpOverload) or target is operator.getitem
        ):
            continue
        if isinstance(target, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in target.tags
            or target._schema.is_mutable
            or not target._schema.returns
        ):
            continue
        if not all(a in values for a in node.all_input_nodes):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda x: values[x])
        with torch.no_grad():
            values[node] = target(*args, **kwargs)
    return {n: v for n, v in values.items() if isinstance(v, torch.Tensor)}


def _folded_assert(node: fx.Node, folded: Mapping[fx.Node, torch.Tensor]) -> bool:
    """A metadata assertion on a folded value: true at capture, so true ever after."""
    return (
        node.target is aten._assert_tensor_metadata.default
        and bool(node.all_input_nodes)
        and all(a in folded for a in node.all_input_nodes)
    )


def _known_mask(args: dict[str, Any], folded: Mapping[fx.Node, torch.Tensor]) -> dict[str, Any]:
    """scaled_dot_product_attention's arguments with a folded mask simplified: none if it
    hides nothing, `is_causal` if it is the causal mask (a boolean mask or an additive one
    of zeros and -inf), else unchanged."""
    mask = args.get("attn_mask")
    if not isinstance(mask, fx.Node) or mask not in folded or args.get("is_causal"):
        return args
    value = folded[mask]
    visible = value if value.dtype == torch.bool else value == 0
    if value.dtype != torch.bool and not bool(((value == 0) | (value == float("-inf"))).all()):
        return args
    if bool(visible.all()):
        return {**args, "attn_mask": None}
    t, s = visible.shape[-2:]
    causal = torch.ones(t, s, dtype=torch.bool).tril()
    if t == s and bool((visible == causal).all()):
        return {**args, "attn_mask": None, "is_causal": True}
    return args


def _written_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes some operator writes in place (graph inputs among them: BatchNorm's
    statistics...)."""
    written: set[fx.Node] = set()
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        for i, a in enumerate(target._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if isinstance(value, fx.Node):
                written.add(value)
    return written
