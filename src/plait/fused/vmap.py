"""`VmapArray`: the generic fallback, B models of any architecture under torch.func.vmap.

It runs the unchanged stock forward once per model inside `vmap` over stacked weights,
so it accepts any model, including those `plait.fuse` cannot rewrite layer by layer
(Hugging Face `transformers` models among them), with the interface of a fused array:
[B, N, ...] inputs, stacked state_dict keys, `to_models()`, `load_models()`, `keep()`.
Random ops draw independently per model.

Three things a stock model may do that `vmap` cannot follow are handled here:

- Tied parameters (GPT-2's `lm_head.weight` is `transformer.wte.weight`): the array
  holds one stacked parameter under every name of the tie, so the optimizer steps it
  once and each exported state_dict has every key the stock model's has.
- Caches: a model whose config has `use_cache` returns a cache object (a `DynamicCache`
  for Llama and GPT-2) that is not a tensor and cannot be batched. Training never reads
  it, so the template's configs get `use_cache = False`.
- Embeddings with a `padding_idx`: torch's batching rule for the embedding backward
  (torch 2.13) keeps the padding row's gradient at zero for model 0 only, so the array
  zeroes each model's padding row of the gradient itself.
- Outputs that are `ModelOutput`s or dicts come back as the same type with every tensor
  leading with B (a model's own `.loss` becomes the [B] per-model losses); any other
  non-tensor value in the output becomes None.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.utils import _pytree as pytree

from plait.fused.array import ModelArrayMixin, check_same_structure

logger = logging.getLogger(__name__)


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """{alias: canonical name} for every parameter reachable under more than one name.

    The canonical name is the first one `named_parameters()` yields (the one it keeps).
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def disable_caches(model: nn.Module) -> list[str]:
    """Turn off `config.use_cache` everywhere in `model`; the paths of changed modules.

    Models of `transformers` return their key/value cache from every training forward
    unless told not to; the cache is an object `vmap` cannot batch, and training never
    reads it.
    """
    changed = []
    seen: set[int] = set()
    for path, sub in model.named_modules():
        config = getattr(sub, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", False):
            config.use_cache = False
            changed.append(path or type(model).__name__)
    return changed


class _ZeroPaddingRows:
    """Gradient hook of a stacked embedding table: zero row `padding[b]` of model b.

    `active` is off while the table's gradient comes from a forward that keeps padding
    rows out of it itself (a captured array's fused lookup).
    """

    def __init__(self, padding: list[int | None]) -> None:
        self.padding = padding
        self.active = True

    def keep(self, index: torch.Tensor) -> None:
        self.padding = [self.padding[int(i)] for i in index]

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        rows = [(b, pad) for b, pad in enumerate(self.padding) if pad is not None]
        if not rows or not self.active:
            return grad
        grad = grad.clone()
        for b, pad in rows:
            grad[b, pad] = 0
        return grad


def _set_path(root: nn.Module, path: str, value: nn.Parameter) -> None:
    parent, _, leaf = path.rpartition(".")
    root.get_submodule(parent)._parameters[leaf] = value


def _tensors_only(out: Any) -> Any:
    """`out` with every leaf that is not a tensor replaced by None (vmap returns tensors)."""
    leaves, spec = pytree.tree_flatten(out)
    dropped = {type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor | None)}
    if not dropped:
        return out
    logger.debug("the model's output holds %s; the array returns None there", sorted(dropped))
    kept = [x if isinstance(x, torch.Tensor) else None for x in leaves]
    return pytree.tree_unflatten(kept, spec)


class VmapArray(ModelArrayMixin, nn.Module):
    """B models of one architecture, run with `torch.func.vmap` over stacked weights.

    Call it like the stock model, with every tensor argument (positional or keyword)
    leading with B; other arguments are shared by all models. Outputs keep the stock
    model's type (tensor, tuple, dict or `ModelOutput`) with every tensor leading with B.
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        super().__init__()
        models = list(models)
        check_same_structure(models)
        self.num_models = len(models)
        first = models[0]
        self._tied = tied_parameters(first)
        # The stock module serves as a stateless template; it is kept out of the module
        # tree so that the array's own tensors are the stacked ones.
        self._skeleton: nn.Module
        object.__setattr__(self, "_skeleton", self._template(first))
        self._param_names = [n for n, _ in first.named_parameters()]
        self._buffer_names = [n for n, _ in first.named_buffers()]
        for name in self._param_names:
            stacked = torch.stack([m.get_parameter(name).detach() for m in models]).clone()
            self._install(name, nn.Parameter(stacked))
        for alias, name in self._tied.items():  # the same Parameter under every name
            self._install(alias, self.get_parameter(name))
        self._padding_hooks: list[_ZeroPaddingRows] = []
        for path, layer in first.named_modules():
            if isinstance(layer, nn.Embedding):
                pads: list[int | None] = [
                    getattr(m.get_submodule(path), "padding_idx", None) for m in models
                ]
                if any(p is not None for p in pads):
                    hook = _ZeroPaddingRows(pads)
                    self.get_parameter(f"{path}.weight").register_hook(hook)
                    self._padding_hooks.append(hook)
        for name in self._buffer_names:
            stacked = torch.stack([m.get_buffer(name) for m in models]).clone()
            parent, _, leaf = name.rpartition(".")
            persistent = leaf not in first.get_submodule(parent)._non_persistent_buffers_set
            self._install(name, stacked, persistent=persistent)

    def _template(self, first: nn.Module) -> nn.Module:
        skeleton = copy.deepcopy(first).to("meta")
        # `.to()` replaces each module's parameters one by one, which unties them;
        # functional_call ties names again only where the template shares the object.
        for alias, name in self._tied.items():
            _set_path(skeleton, alias, skeleton.get_parameter(name))
        changed = disable_caches(skeleton)
        self._caches_disabled = [
            path for path, sub in skeleton.named_modules() if path in changed or (
                not path and type(first).__name__ in changed)
        ]  # fmt: skip
        if changed:
            logger.info("%s: use_cache turned off for training as an array", ", ".join(changed))
        return skeleton

    def _install(self, path: str, value: torch.Tensor, *, persistent: bool = True) -> None:
        *parents, leaf = path.split(".")
        mod: nn.Module = self
        for p in parents:
            if p not in mod._modules:
                mod.add_module(p, nn.Module())
            mod = mod._modules[p]  # type: ignore[assignment]
        if isinstance(value, nn.Parameter):
            mod.register_parameter(leaf, value)
        else:
            mod.register_buffer(leaf, value, persistent=persistent)

    def keep_models(self, index: torch.Tensor) -> None:
        self.num_models = int(index.numel())
        for hook in self._padding_hooks:
            hook.keep(index)

    def _use_padding_hooks(self, active: bool) -> None:
        for hook in self._padding_hooks:
            hook.active = active

    def train(self, mode: bool = True) -> VmapArray:
        super().train(mode)
        self._skeleton.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params: dict[str, torch.Tensor] = {n: self.get_parameter(n) for n in self._param_names}
        buffers = {n: self.get_buffer(n) for n in self._buffer_names}
        skeleton = self._skeleton

        def one(
            p: dict[str, torch.Tensor],
            b: dict[str, torch.Tensor],
            xs: tuple[Any, ...],
            kw: dict[str, Any],
        ) -> Any:
            return _tensors_only(functional_call(skeleton, (p, b), xs, kw))

        def dims(a: Any) -> int | None:
            return 0 if isinstance(a, torch.Tensor) else None

        in_dims = (0, 0, tuple(dims(a) for a in args), {k: dims(v) for k, v in kwargs.items()})
        return vmap(one, in_dims=in_dims, randomness="different")(params, buffers, args, kwargs)
