"""`plait.fuse`: turn an ordinary nn.Module into a horizontally fused array of B models.

The first model's forward is traced with torch.fx. Each stock layer becomes its fused
layer (weights of all B models stacked), each function or method call gets its batching
rule (see `plait.fused.rules`), and the rewritten graph runs every model in one pass on
[B, N, ...] inputs. The user's model code is not changed. A layer or call with no fused
form raises `UnsupportedLayerError` naming it, or, with `fallback="vmap"`, the models
train as a `VmapArray` with the same interface.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

import torch
from torch import fx, nn

from plait.fused.array import ModelArrayMixin, check_same_structure
from plait.fused.capture import CapturedArray
from plait.fused.errors import UnsupportedLayerError
from plait.fused.ops import ELEMENTWISE, FUSED_LAYERS, supported_layers
from plait.fused.ops.base import FusedModule, expand_models
from plait.fused.rules import any_batched, batched_call
from plait.fused.vmap import VmapArray

logger = logging.getLogger(__name__)


class Fallback(StrEnum):
    """What `fuse` does with a model it cannot fuse layer by layer."""

    NONE = "none"  # raise UnsupportedLayerError naming the layer
    VMAP = "vmap"  # train it as a torch.func (vmap) array instead


class Capture(StrEnum):
    """How `fuse` reads the model's forward."""

    AUTO = "auto"  # torch.fx where it traces and fuses, else torch.export on the first call
    FX = "fx"  # torch.fx symbolic tracing only
    EXPORT = "export"  # torch.export on the first call (per input signature)


class FusedArray(ModelArrayMixin, fx.GraphModule):
    """B models of one architecture trained as one: every tensor leads with B.

    Call it with inputs of shape [B, N, ...] (model b reads [b]); outputs lead with B.
    `state_dict()` has the stock model's keys with B first; `to_models()`,
    `load_models()` and `keep()` export, import and prune models. `print(array.code)`
    shows the fused forward.
    """

    num_models: int

    def keep_models(self, index: torch.Tensor) -> None:
        self.num_models = int(index.numel())

    @classmethod
    def from_models(cls, models: Sequence[nn.Module]) -> FusedArray:
        """Fuse existing stock models (identical architectures), copying their weights."""
        array = fuse(list(models))
        assert isinstance(array, FusedArray)
        return array


class LayerArray(ModelArrayMixin, FusedModule):
    """An array of B models that are each a single stock layer: the fused layer itself."""


_LAYER_ARRAYS: dict[type[FusedModule], type[LayerArray]] = {}


def _layer_array(models: list[nn.Module]) -> LayerArray:
    fused_cls = FUSED_LAYERS[type(models[0])]
    cls = _LAYER_ARRAYS.get(fused_cls)
    if cls is None:
        name = f"{fused_cls.__name__}Array"
        cls = _LAYER_ARRAYS[fused_cls] = type(
            name, (LayerArray, fused_cls), {"__module__": __name__}
        )
    return cls.from_modules(models)


class _Tracer(fx.Tracer):
    """Stops at every stock layer (fused or not), so each can be mapped or reported."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if type(m) in FUSED_LAYERS or isinstance(m, ELEMENTWISE):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _materialize(
    models: nn.Module | Sequence[nn.Module] | Callable[[], nn.Module], n: int | None
) -> list[nn.Module]:
    if isinstance(models, nn.Module):
        if n is None or n < 1:
            raise ValueError("fuse(module, n=...) needs n >= 1 copies")
        return [copy.deepcopy(models) for _ in range(n)]
    if isinstance(models, Sequence):
        out = list(models)
        if not out or not all(isinstance(m, nn.Module) for m in out):
            raise ValueError("fuse() needs a non-empty sequence of nn.Modules")
        if n is not None and n != len(out):
            raise ValueError(f"fuse() got {len(out)} models but n={n}")
        return out
    if callable(models):
        if n is None or n < 1:
            raise ValueError("fuse(factory, n=...) needs the number of models n >= 1")
        built = [models() for _ in range(n)]
        if not all(isinstance(m, nn.Module) for m in built):
            raise ValueError("the factory given to fuse() must return nn.Modules")
        return built
    raise ValueError(f"fuse() needs a module factory or a list of modules, got {models!r}")


def fuse(
    models: nn.Module | Sequence[nn.Module] | Callable[[], nn.Module],
    n: int | None = None,
    *,
    fallback: Fallback | str = Fallback.NONE,
    capture: Capture | str = Capture.AUTO,
) -> FusedArray | LayerArray | VmapArray:
    """Fuse B models of one architecture into one array.

    Args:
        models: a factory called `n` times (independent initialisations, as separate runs
            would have), a list of B models (their weights are copied), or one module
            copied `n` times (identical initial weights).
        n: the number of models B (required with a factory or a single module).
        fallback: "vmap" trains models that cannot be fused layer by layer as a
            `VmapArray` (torch.func) with the same interface; "none" raises instead.
        capture: "fx" traces the forward with torch.fx once, now; "export" captures it
            with torch.export on the first call (and on each new input signature),
            resolving Python control flow on those inputs (a `CapturedArray`); "auto"
            (the default) uses torch.fx where it traces and fuses the model, and
            torch.export otherwise.

    Raises:
        UnsupportedLayerError: a layer or call has no fused form (named in the message);
            a captured array raises it on its first call, naming the graph node.
        StructureMismatchError: the models differ in structure (the place is named).
    """
    fallback = Fallback(fallback)
    capture = Capture(capture)
    built = _materialize(models, n)
    check_same_structure(built)
    if capture is not Capture.EXPORT:
        try:
            return _convert(built)
        except UnsupportedLayerError as e:
            if capture is Capture.FX:
                if fallback is Fallback.VMAP:
                    return VmapArray(built)
                raise
            reason = e.__cause__ if e.__cause__ is not None else e
            logger.info("%s: torch.fx cannot fuse it (%s: %s); capturing it with torch.export",
                        type(built[0]).__name__, type(reason).__name__, reason)  # fmt: skip
    return CapturedArray(built, fallback=fallback is Fallback.VMAP)


def _convert(models: list[nn.Module]) -> FusedArray | LayerArray:
    first = models[0]
    name = type(first).__name__
    if type(first) in FUSED_LAYERS:  # the model is one stock layer
        return _layer_array(models)
    try:
        graph = _Tracer().trace(first)
    except Exception as exc:  # symbolic tracing fails on data-dependent control flow
        raise UnsupportedLayerError(
            f"{name}.forward cannot be traced for fusion ({type(exc).__name__}: {exc}); "
            "pass fallback='vmap' to train it as a torch.func (vmap) array"
        ) from exc
    root = nn.Module()
    root.num_models = len(models)  # type: ignore[assignment]
    params = dict(first.named_parameters())
    buffers = dict(first.named_buffers())
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    batched: dict[fx.Node, bool] = {}
    num_models_node: list[fx.Node] = []
    constants: dict[str, Any] = {}

    def flag(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return batched[a]
        if isinstance(a, list | tuple):
            return tuple(flag(x) for x in a)
        if isinstance(a, dict):
            return any(any_batched(flag(x)) for x in a.values())
        return False

    def b_node() -> fx.Node:
        if not num_models_node:
            num_models_node.append(new.get_attr("num_models"))
        return num_models_node[0]

    for node in graph.nodes:
        where = f"{name}.forward"
        if node.op in ("placeholder", "output"):
            env[node] = new.node_copy(node, lambda x: env[x])
            batched[node] = node.op == "placeholder"
        elif node.op == "get_attr":
            target = str(node.target)
            if target in params or target in buffers:
                _install_stacked(root, models, target, is_param=target in params)
                batched[node] = True
            else:  # a constant fx captured while tracing: shared by all models
                constants[target] = _resolve(graph.owning_module or first, target)
                _install(root, target, constants[target])
                batched[node] = False
            env[node] = new.node_copy(node, lambda x: env[x])
        elif node.op == "call_module":
            path = str(node.target)
            layer = first.get_submodule(path)
            if isinstance(layer, ELEMENTWISE) and type(layer) not in FUSED_LAYERS:
                if not _has(root, path):
                    _install(root, path, layer)
                env[node] = new.node_copy(node, lambda x: env[x])
                batched[node] = any_batched(flag(node.args))
                continue
            fused_cls = FUSED_LAYERS.get(type(layer))
            if fused_cls is None:
                raise UnsupportedLayerError(
                    f"layer '{path}' ({type(layer).__module__}.{type(layer).__qualname__}) "
                    f"cannot be fused. Fusable layers: {', '.join(supported_layers())}, and any "
                    "module whose forward uses only these. Pass fallback='vmap' to train "
                    "it as a torch.func (vmap) array instead"
                )
            if not _has(root, path):
                _install(
                    root, path, fused_cls.from_modules([m.get_submodule(path) for m in models])
                )

            def share(a: Any) -> Any:
                if isinstance(a, fx.Node) and not batched[a]:
                    return new.call_function(expand_models, (env[a], b_node()))
                if isinstance(a, fx.Node):
                    return env[a]
                return a

            args = tuple(share(a) for a in node.args)
            kwargs = {k: share(v) for k, v in node.kwargs.items()}
            env[node] = new.call_module(path, args, kwargs)
            batched[node] = True
        else:  # call_function, call_method
            fa = tuple(flag(a) for a in node.args)
            fk = {k: flag(v) for k, v in node.kwargs.items()}
            if not any_batched(fa) and not any(any_batched(f) for f in fk.values()):
                env[node] = new.node_copy(node, lambda x: env[x])
                batched[node] = False
                continue
            impl, out_batched = batched_call(
                node.target, is_method=node.op == "call_method", args=node.args, fa=fa,
                fk=fk, where=where,
            )  # fmt: skip
            env[node] = new.call_function(
                impl,
                fx.node.map_arg(node.args, lambda x: env[x]),
                fx.node.map_arg(node.kwargs, lambda x: env[x]),
            )
            batched[node] = out_batched

    array = FusedArray(root, new, class_name=f"Fused{name}")
    array.num_models = len(models)
    for path, value in constants.items():  # fx would save them as persistent buffers
        if isinstance(value, torch.Tensor):
            parent, _, leaf = path.rpartition(".")
            owner = array.get_submodule(parent)
            del owner._buffers[leaf]
            owner.register_buffer(leaf, value, persistent=False)
    _complete_state(array, models)
    return array


def _resolve(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _has(root: nn.Module, path: str) -> bool:
    try:
        _resolve(root, path)
    except AttributeError:
        return False
    return True


def _install(root: nn.Module, path: str, value: Any, *, persistent: bool = True) -> None:
    *parents, leaf = path.split(".")
    mod = root
    for p in parents:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, nn.Module):
        mod.add_module(leaf, value)
    elif isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(leaf, value, persistent=persistent)
    else:
        setattr(mod, leaf, value)


def _install_stacked(
    root: nn.Module, models: list[nn.Module], path: str, *, is_param: bool
) -> None:
    if _has(root, path):
        return
    tensors = [_resolve(m, path).detach() for m in models]
    stacked = torch.stack(tensors).clone()
    if is_param:
        requires_grad = bool(_resolve(models[0], path).requires_grad)
        _install(root, path, nn.Parameter(stacked, requires_grad=requires_grad))
        return
    parent, _, leaf = path.rpartition(".")
    owner = models[0].get_submodule(parent)
    _install(root, path, stacked, persistent=leaf not in owner._non_persistent_buffers_set)


def _complete_state(array: FusedArray, models: list[nn.Module]) -> None:
    """Stack tensors the forward never touches, so export gives complete state_dicts."""
    have = array.state_dict().keys()
    params = dict(models[0].named_parameters())
    for key in models[0].state_dict():
        if key not in have:
            _install_stacked(array, models, key, is_param=key in params)
    extra = array.state_dict().keys() - models[0].state_dict().keys()
    assert not extra, f"fused array holds tensors the model does not: {sorted(extra)}"
