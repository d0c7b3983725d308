"""The fused optimizer base: per-model hyper-parameters, one flat update for all models.

A fused array's parameters are [B, ...]. A fused optimizer keeps each group's state as
flat [B, T] buffers (T = one model's parameter count in the group) and the per-param
state that `torch.optim.Optimizer.state_dict` saves as views into them. Each step
gathers the gradients into one [B, T] tensor with one foreach copy, runs the update rule
once with every per-model hyper-parameter as a [B, 1] coefficient, and adds the result
back with one foreach call: the kernel count of a single small model's step, whatever B
is, and no per-parameter work in Python beyond building the list of gradients.

Hyper-parameters named in `per_model_keys` accept a number (all models) or a length-B
sequence; groups store one number when all models agree and a list otherwise, so
`param_groups`, `state_dict()` and `load_state_dict()` work as in torch.optim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch._C._autograd import _profiler_enabled
from torch.optim import optimizer as _torch_optim

from plait.fused.hparams import coefficient, compact, per_model, per_model_pairs


@dataclass
class _Layout:
    """Where each parameter of a group sits in the group's flat [B, T] buffers."""

    params: list[torch.Tensor]
    sizes: list[int]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    step: torch.Tensor | None = None
    work: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Per-parameter views of the flat buffers that persist across steps, made once, so
    #: that a step does not split them again parameter by parameter (about 2 us each).
    views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self.params)


class FusedOptimizer(torch.optim.Optimizer):
    """Base of fused optimizers; subclasses define `update` and their state names.

    Args:
        params: parameters of a fused array (or param groups), each [B, ...].
        defaults: default hyper-parameters.
        num_models: B; inferred from the parameters' leading dimension when omitted.
    """

    #: Hyper-parameters that may take one value per model.
    per_model_keys: ClassVar[tuple[str, ...]] = ("lr",)
    #: Pair-valued hyper-parameters (Adam's betas) that may take one pair per model.
    pair_keys: ClassVar[tuple[str, ...]] = ()
    #: Names of the flat state buffers, in the order of torch.optim's per-param state.
    state_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        num_models: int | None = None,
    ) -> None:
        self._num_models = num_models
        self._layouts: dict[int, _Layout] = {}
        self._coef_cache: dict[tuple[Any, ...], torch.Tensor] = {}
        self._current: _Layout | None = None
        super().__init__(params, defaults)

    @property
    def num_models(self) -> int:
        if self._num_models is None:
            raise ValueError("the optimizer has no parameters yet")
        return self._num_models

    # ------------------------------------------------------------------ groups and values

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.dim() == 0:
                raise ValueError("fused optimizers need [B, ...] parameters of a model array")
            b = int(p.shape[0])
            if self._num_models is None:
                self._num_models = b
            elif b != self._num_models:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} does not lead with the array's "
                    f"{self._num_models} models"
                )
        self._normalise(group)

    def _normalise(self, group: dict[str, Any]) -> None:
        b = self.num_models
        for key in self.per_model_keys:
            group[key] = compact(per_model(group[key], num_models=b, name=key))
        for key in self.pair_keys:
            pairs = per_model_pairs(group[key], num_models=b, name=key)
            group[key] = pairs[0] if all(p == pairs[0] for p in pairs) else pairs

    def values(self, group: dict[str, Any], key: str) -> list[float]:
        """Every model's value of hyper-parameter `key` in `group`."""
        return per_model(group[key], num_models=self.num_models, name=key)

    def pairs(self, group: dict[str, Any], key: str) -> list[tuple[float, float]]:
        return per_model_pairs(group[key], num_models=self.num_models, name=key)

    def coef(self, values: Sequence[float], like: torch.Tensor) -> float | torch.Tensor:
        """Per-model values as a [B, 1] tensor, or one float when every model shares it.

        A float keeps torch's scalar kernels (and their rounding) for the common case
        where only some hyper-parameters differ between models.
        """
        first = values[0]
        if all(v == first for v in values):
            return float(first)
        key = (tuple(values), like.dtype, like.device)
        t = self._coef_cache.get(key)
        if t is None:
            if len(self._coef_cache) > 256:
                self._coef_cache.clear()
            t = self._coef_cache[key] = coefficient(values, like)
        return t

    # ----------------------------------------------------------------------- flat state

    def init_state(self, group: dict[str, Any], name: str, like: torch.Tensor) -> torch.Tensor:
        """The initial value of state buffer `name` (zeros unless a subclass says otherwise)."""
        del group
        return torch.zeros_like(like)

    def _layout(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> _Layout:
        layout = self._layouts.get(index)
        if layout is not None and layout.key == tuple(id(p) for p in params):
            return layout
        b = self.num_models
        layout = _Layout(params=params, sizes=[p[0].numel() for p in params])
        like = torch.cat([p.detach().reshape(b, -1) for p in params], 1)
        for name in self.state_keys:
            parts = [self.state[p].get(name) for p in params]
            if all(t is None for t in parts):
                if name in self.lazy_state_keys():
                    continue
                flat = self.init_state(group, name, like)
            else:
                flat = torch.cat(
                    [torch.zeros_like(p).reshape(b, -1) if t is None else t.reshape(b, -1)
                     for p, t in zip(params, parts, strict=True)], 1,
                ).to(like.dtype)  # fmt: skip
            self._set_flat(layout, name, flat)
        steps = [self.state[p].get("step") for p in params]
        known = [s for s in steps if s is not None]
        step = known[0].to(torch.float32).reshape(-1).clone() if known else torch.zeros(b)
        layout.step = step.expand(b).clone() if step.numel() == 1 else step
        for p in params:
            self.state[p]["step"] = layout.step
        self._layouts[index] = layout
        return layout

    def lazy_state_keys(self) -> tuple[str, ...]:
        """State buffers created on the first step from the gradient (SGD's momentum)."""
        return ()

    def _set_flat(self, layout: _Layout, name: str, flat: torch.Tensor) -> None:
        layout.buffers[name] = flat
        for p, view in zip(layout.params, flat.split(layout.sizes, 1), strict=True):
            self.state[p][name] = view.view(p.shape)

    @staticmethod
    def _views(flat: torch.Tensor, layout: _Layout) -> list[torch.Tensor]:
        """`flat` [B, T] split into views of each parameter's shape; cached for the
        group's persistent state and scratch buffers (a fresh tensor gets fresh views)."""
        cached = layout.views.get(id(flat))
        if cached is not None and cached[0] is flat:
            return cached[1]
        parts = flat.split(layout.sizes, 1)
        views = [d.view(p.shape) for d, p in zip(parts, layout.params, strict=True)]
        persistent = (*layout.work.values(), *layout.buffers.values())
        if any(flat is t for t in persistent):  # also forget buffers since replaced
            layout.views = {k: v for k, v in layout.views.items()
                            if any(v[0] is t for t in persistent)}  # fmt: skip
            layout.views[id(flat)] = (flat, views)
        return views

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # torch may keep the loaded tensors themselves; own copies keep the saved state
        # (often views of another optimizer's flat buffers) out of this one's updates
        for p, state in list(self.state.items()):
            self.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                             for k, v in state.items()}  # fmt: skip
        self._layouts.clear()
        for group in self.param_groups:
            self._normalise(group)

    @torch.no_grad()
    def keep(self, index: Sequence[int] | torch.Tensor) -> None:
        """Keep only the models at `index`; call it with the array's `keep(index)`."""
        idx = torch.as_tensor(list(index) if not isinstance(index, torch.Tensor) else index,
                              dtype=torch.long)  # fmt: skip
        old = self.num_models
        for group in self.param_groups:
            for key in self.per_model_keys:
                group[key] = compact([self.values(group, key)[i] for i in idx.tolist()])
            for key in self.pair_keys:
                pairs = [self.pairs(group, key)[i] for i in idx.tolist()]
                group[key] = pairs[0] if all(p == pairs[0] for p in pairs) else pairs
        done: dict[int, torch.Tensor] = {}
        for state in self.state.values():
            for name, t in list(state.items()):
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == old:
                    if id(t) not in done:
                        done[id(t)] = t[idx.to(t.device)].clone()
                    state[name] = done[id(t)]
        self._num_models = int(idx.numel())
        self._layouts.clear()
        self._coef_cache.clear()

    # ---------------------------------------------------------------------------- step

    def work(
        self, name: str, like: torch.Tensor, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """A scratch buffer of `like`'s shape (or `shape`) kept across steps, contents
        undefined: large flat temporaries are allocated once, not every step."""
        assert self._current is not None, "work() is for update()"
        shape = tuple(like.shape) if shape is None else shape
        buf = self._current.work.get(name)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != like.dtype:
            buf = self._current.work[name] = like.new_empty(shape)
        return buf

    def step_in_place(
        self, group: dict[str, Any], layout: _Layout, grads: list[torch.Tensor]
    ) -> bool:
        """Update the group's parameters and state straight from `grads` (the step count
        already advanced) and return True, or return False for the flat `update` path.

        A subclass overrides it where a kernel can read every gradient in place.
        """
        del group, layout, grads
        return False

    @staticmethod
    def axpy(a: torch.Tensor, x: torch.Tensor, c: float | torch.Tensor) -> torch.Tensor:
        """a + x * c, for a per-model [B, 1] or a shared scalar c (new tensor)."""
        return a.add(x, alpha=c) if isinstance(c, float) else torch.addcmul(a, x, c)

    def l2(
        self, group: dict[str, Any], grad: torch.Tensor, param: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """grad + weight_decay * param per model (torch.optim's coupled weight decay); the
        flat parameters are only read when some model decays."""
        wd = self.values(group, "weight_decay")
        return self.axpy(grad, param(), self.coef(wd, grad)) if any(wd) else grad

    def update(
        self,
        group: dict[str, Any],
        buffers: dict[str, torch.Tensor],
        step: torch.Tensor,
        grad: torch.Tensor,
        param: Callable[[], torch.Tensor],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The [B, T] increment of the flat parameters (subclasses implement the rule).

        It returns the increment, or a pair (numerator, denominator) whose quotient is
        the increment, which the step applies with one foreach addcdiv.

        Args:
            group: the param group (hyper-parameters).
            buffers: the group's flat state, updated in place.
            step: [B] steps taken so far, this one included.
            grad: [B, T] gradients.
            param: returns the [B, T] current parameters (gathered only when asked for).
        """
        raise NotImplementedError

    @staticmethod
    def profile_hook_step(func: Callable[..., Any]) -> Callable[..., Any]:
        """torch.optim's wrapper of `step` (step hooks and a profiler scope), entered only
        when a hook is registered or a profiler is recording; otherwise `step` runs
        directly.

        Inside a training loop the wrapper cost a small array's step about 5% (MLP of
        16 models), and a fused array has one optimizer where serial training has one
        per model.
        """
        hooked = torch.optim.Optimizer.profile_hook_step(func)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            opt = args[0]
            assert isinstance(opt, torch.optim.Optimizer)
            if (
                _profiler_enabled()
                or opt._optimizer_step_pre_hooks
                or opt._optimizer_step_post_hooks
                or _torch_optim._global_optimizer_pre_hooks
                or _torch_optim._global_optimizer_post_hooks
            ):
                return hooked(*args, **kwargs)
            return func(*args, **kwargs)

        return wrapper

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's `zero_grad`; dropping the gradients skips its profiler scope
        unless a profiler is recording.

        The scope and bookkeeping around a loop over a handful of parameters cost a small
        array's training step about 6% (MLP of 16 models: 68 against 10 us per call,
        measured inside the training loop).
        """
        if not set_to_none or _profiler_enabled():
            super().zero_grad(set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        b = self.num_models
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            layout = self._layout(index, group, params)
            self._current = layout
            grads = [p.grad for p in params if p.grad is not None]
            assert layout.step is not None
            layout.step += 1
            if self.step_in_place(group, layout, grads):
                continue
            if len(grads) == 1:
                grad = grads[0].reshape(b, -1)
            else:  # one foreach copy into cached views of the flat gradient
                grad = self.work("grad", grads[0], (b, sum(layout.sizes)))
                torch._foreach_copy_(self._views(grad, layout), grads)
            if group.get("maximize", False):
                grad = -grad
            cache: list[torch.Tensor] = []

            def param(layout: _Layout = layout, cache: list[torch.Tensor] = cache) -> torch.Tensor:
                if not cache:
                    flat = [p.detach().reshape(b, -1) for p in layout.params]
                    cache.append(flat[0] if len(flat) == 1 else torch.cat(flat, 1))
                return cache[0]

            delta = self.update(group, layout.buffers, layout.step, grad, param)
            for name, flat in layout.buffers.items():  # lazily created buffers get views
                if self.state[params[0]].get(name) is None:
                    self._set_flat(layout, name, flat)
            if isinstance(delta, tuple):
                num, den = (self._views(t, layout) for t in delta)
                torch._foreach_addcdiv_(params, num, den)
            else:
                torch._foreach_add_(params, self._views(delta, layout))
        return loss
