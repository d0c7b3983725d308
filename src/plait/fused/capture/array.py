"""`CapturedArray`: B models fused from their PyTorch 2 graph, captured on the first call.

torch.fx's symbolic tracing stops at Python control flow on tensors and at code it
cannot run on proxies, which is most of what `transformers` ships. `torch.export`
(non-strict) runs the forward on the example inputs instead, resolving every branch, and
records the ATen operators it reached. A `CapturedArray` holds the B models' weights
stacked under the stock names (as `VmapArray` does: tied parameters once, every key the
stock model has) and, per input signature (per-model shapes, dtypes, train or eval,
non-tensor arguments), exports model 0 once on a one-model slice of the inputs and runs
the rewritten graph (`rewrite.FusedGraph`) on the whole array from then on.

Graphs are cached per model structure (a fingerprint of the module tree, its settings
and its tensors' shapes) and input signature across arrays in the process, so the arrays
of a sweep export once. A node with no fused form raises `UnsupportedLayerError` naming
the node and its layer; with `fallback="vmap"` that signature runs under torch.func's
vmap instead (logged once).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from plait.fused.capture.patterns import simplify
from plait.fused.capture.rewrite import FusedGraph, SlotKind, rewrite
from plait.fused.errors import StructureMismatchError, UnsupportedLayerError
from plait.fused.ops.base import expand_models
from plait.fused.vmap import VmapArray

logger = logging.getLogger(__name__)

#: Fused graphs kept per process, by (model fingerprint, input signature). A sweep
#: builds many arrays of one model on one input shape, so a handful suffices.
CACHE_SIZE = 32
_CACHE: OrderedDict[tuple[str, Any], FusedGraph | UnsupportedLayerError] = OrderedDict()

#: Per-model layer settings a fused graph reads at run time: (layer type, attribute).
_SETTINGS: tuple[tuple[type[nn.Module], str], ...] = ((nn.Dropout, "p"),
                                                      (nn.Embedding, "padding_idx"))  # fmt: skip

_SKIPPED = frozenset({"_parameters", "_buffers", "_modules", "training"})


def _describe(value: Any) -> Any:
    """A hashable description of a module attribute that may steer its forward."""
    if isinstance(value, bool | int | float | str | type(None) | torch.dtype):
        return value
    if isinstance(value, list | tuple) and all(
        isinstance(v, bool | int | float | str | type(None)) for v in value
    ):
        return tuple(value)
    to_dict = getattr(value, "to_dict", None)  # a transformers config
    if callable(to_dict):
        try:
            return repr(sorted(to_dict().items()))
        except (TypeError, ValueError):
            return type(value).__qualname__
    return None


def _settings(module: nn.Module, *, per_model: bool) -> list[tuple[str, Any]]:
    out = []
    for k, v in sorted(vars(module).items()):
        if k in _SKIPPED or (k.startswith("_") and k.endswith("hooks")):
            continue
        if not per_model and any(isinstance(module, t) and k == a for t, a in _SETTINGS):
            continue
        d = _describe(v)
        if d is not None:
            out.append((k, d))
    return out


def structure(model: nn.Module, *, per_model: bool = True) -> list[tuple[str, Any]]:
    """What may steer a model's forward: every module's type and plain settings (configs
    included) and every tensor's name, shape and dtype. Without `per_model`, the settings
    a fused graph reads per model (dropout p, padding index) are left out."""
    parts: list[tuple[str, Any]] = [
        ("class", f"{type(model).__module__}.{type(model).__qualname__}")
    ]
    for path, m in model.named_modules():
        parts.append((path, (type(m).__qualname__, tuple(_settings(m, per_model=per_model)))))
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        parts.append((name, (tuple(t.shape), str(t.dtype))))
    return parts


def fingerprint(model: nn.Module) -> str:
    return hashlib.sha256(repr(structure(model, per_model=False)).encode()).hexdigest()


def _check_members(models: Sequence[nn.Module]) -> None:
    """Models whose forwards could differ beyond per-model settings cannot share a graph."""
    first = structure(models[0], per_model=False)
    for i, m in enumerate(models[1:], start=1):
        for (path, a), (_, b) in zip(first, structure(m, per_model=False), strict=True):
            if a != b:
                raise StructureMismatchError(
                    f"model {i} differs from model 0 at '{path or 'the top level'}': "
                    f"{b} where model 0 has {a}"
                )


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], training: bool) -> Any:
    """What a captured graph is specialised on: the inputs' structure, per-model shapes,
    dtypes and devices, the values of non-tensor inputs, and train or eval."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape[1:]), x.dtype, x.device.type))
        else:
            parts.append(("value", x if isinstance(x, int | float | bool | str) else repr(x)))
    return training, spec, tuple(parts)


class CapturedArray(VmapArray):
    """B models of one architecture fused from their exported graph (see the module).

    Call it like the stock model with every tensor argument leading with B; outputs keep
    the stock model's type (a `ModelOutput`'s `loss` is the [B] per-model losses).
    `to_models()`, `load_models()`, `keep()` and `to_modules()` work as for every array.
    """

    def __init__(self, models: Sequence[nn.Module], *, fallback: bool = False) -> None:
        models = list(models)
        super().__init__(models)
        _check_members(models)
        self.fallback = fallback
        self._fingerprint = fingerprint(models[0])
        self._graphs: dict[Any, FusedGraph | None] = {}
        self._resolved: dict[int, tuple[FusedGraph, list[Any]]] = {}
        self._layers = dict(self._skeleton.named_modules())
        self._per_model: dict[str, list[Any]] = {}
        for path, layer in models[0].named_modules():
            for layer_type, attr in _SETTINGS:
                if isinstance(layer, layer_type):
                    values = [getattr(m.get_submodule(path), attr) for m in models]
                    self._per_model[f"{path}:{attr}"] = values
        self._shared_buffers = frozenset(
            name
            for name in self._buffer_names
            if self._is_non_persistent(name)
            and all(torch.equal(m.get_buffer(name), models[0].get_buffer(name)) for m in models)
        )

    def _is_non_persistent(self, name: str) -> bool:
        parent, _, leaf = name.rpartition(".")
        return leaf in self._skeleton.get_submodule(parent)._non_persistent_buffers_set

    def keep_models(self, index: torch.Tensor) -> None:
        super().keep_models(index)
        self._resolved.clear()  # keep() replaces the buffers
        rows = index.tolist()
        self._per_model = {k: [v[i] for i in rows] for k, v in self._per_model.items()}

    # ----------------------------------------------------------------------- capture

    def capture(self, *args: Any, **kwargs: Any) -> FusedGraph | None:
        """The fused graph for inputs like these ([B, ...] tensors), captured if new.

        None when the model cannot be fused for them and the array falls back to vmap.

        Raises:
            UnsupportedLayerError: a node cannot be fused and `fallback` is off.
        """
        kwargs = dict(sorted(kwargs.items()))
        key = signature(args, kwargs, self.training)
        if key in self._graphs:
            return self._graphs[key]
        cached = _CACHE.get((self._fingerprint, key))
        if cached is None:
            try:
                cached = self._export(args, kwargs)
            except UnsupportedLayerError as e:
                cached = e
            _CACHE[(self._fingerprint, key)] = cached
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
        if isinstance(cached, UnsupportedLayerError):
            if not self.fallback:
                raise UnsupportedLayerError(
                    f"{cached}. Pass fallback='vmap' to train it as a torch.func (vmap) array"
                ) from cached
            logger.warning("%s; these inputs train under vmap instead", cached)
            self._graphs[key] = None
            return None
        self._graphs[key] = cached
        return cached

    def _export(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FusedGraph:
        model = self._one_model(0)
        model.train(self.training)
        one = pytree.tree_map_only(torch.Tensor, lambda t: t[0], (args, kwargs))
        name = type(model).__name__
        try:
            ep = torch.export.export(model, one[0], one[1], strict=False)
        except Exception as e:  # export reports what it could not follow
            raise UnsupportedLayerError(
                f"{name}.forward cannot be captured by torch.export ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})"
            ) from e
        simplify(ep.graph_module)
        graph = rewrite(ep, model=name, layers=self._layers, shared_buffers=self._shared_buffers)
        logger.info("%s captured and fused: %d graph nodes", name, len(graph.module.graph.nodes))
        return graph

    def _one_model(self, b: int) -> nn.Module:
        """Model b as a stock module: copies of its tensors in the array's dtype and on
        its device, ties kept."""
        model = copy.deepcopy(self._skeleton)
        with torch.no_grad():
            for name in self._param_names:
                p = self.get_parameter(name)
                parent, _, leaf = name.rpartition(".")
                copied = nn.Parameter(p[b].clone(), requires_grad=p.requires_grad)
                model.get_submodule(parent)._parameters[leaf] = copied
            for alias, name in self._tied.items():
                parent, _, leaf = alias.rpartition(".")
                model.get_submodule(parent)._parameters[leaf] = model.get_parameter(name)
            for name in self._buffer_names:
                parent, _, leaf = name.rpartition(".")
                model.get_submodule(parent)._buffers[leaf] = self.get_buffer(name)[b].clone()
        return model

    def to_modules(self) -> list[nn.Module]:
        """Every model as a stock module with its own weights (caches on as built)."""
        models = []
        for b in range(self.num_models):
            model = self._one_model(b)
            for path in self._caches_disabled:
                model.get_submodule(path).config.use_cache = True  # type: ignore[union-attr]
            for key, values in self._per_model.items():
                path, _, attr = key.rpartition(":")
                setattr(model.get_submodule(path), attr, values[b])
            models.append(model)
        return models

    # ----------------------------------------------------------------------- forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        graph = self.capture(*args, **kwargs)
        if graph is None:
            self._use_padding_hooks(True)
            return super().forward(*args, **kwargs)
        self._use_padding_hooks(False)
        return self._run(graph, args, dict(sorted(kwargs.items())))

    def _run(self, graph: FusedGraph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        leaves = iter(pytree.tree_leaves((args, kwargs)))
        state = self._state_for(graph)
        values = [next(leaves) if v is _INPUT else v for v in state]
        outputs = graph.module(*values)
        n = len(graph.mutated)
        with torch.no_grad():
            for name, value in zip(graph.mutated, outputs[:n], strict=True):
                self.get_buffer(name).copy_(value)
        b = self.num_models
        user = [
            o if batched or not isinstance(o, torch.Tensor) else expand_models(o, b)
            for o, batched in zip(outputs[n:], graph.out_batched, strict=True)
        ]
        return pytree.tree_unflatten(user, graph.out_spec)

    def _state_for(self, graph: FusedGraph) -> list[Any]:
        """What the array passes for each of `graph`'s slots (`_INPUT` for the call's
        inputs), resolved once per graph until the array's tensors are replaced."""
        cached = self._resolved.get(id(graph))
        if cached is not None and cached[0] is graph:
            return cached[1]
        values: list[Any] = []
        for slot in graph.slots:
            kind = slot.kind
            if kind is SlotKind.PARAMETER:
                values.append(self.get_parameter(slot.name))
            elif kind is SlotKind.BUFFER:
                values.append(self.get_buffer(slot.name))
            elif kind is SlotKind.SHARED_BUFFER:
                values.append(self.get_buffer(slot.name)[0])
            elif kind is SlotKind.CONSTANT:
                values.append(graph.constants[slot.name])
            elif kind is SlotKind.INPUT:
                values.append(_INPUT)
            else:
                values.append(self._per_model[slot.name])
        self._resolved[id(graph)] = (graph, values)
        return values

    def _apply(self, fn: Any, recurse: bool = True) -> CapturedArray:
        self._resolved.clear()  # .to(), .float(), ...: buffers may be new tensors
        super()._apply(fn, recurse)
        return self


_INPUT = object()  # marks the slots the call's inputs fill


def clear_cache() -> None:
    """Forget every captured graph of this process (they are re-captured on demand)."""
    _CACHE.clear()


__all__ = ["CapturedArray", "clear_cache", "fingerprint", "signature"]
