"""Kronecker-factor math of the layers K-FAC understands: Linear, Conv2d, Embedding, and
every Linear-like layer: Hugging Face's ``Conv1D`` (GPT-2's projections, weight stored
[in, out]) out of the box, and a user's own through `register_layer_type`.

A layer's weight gradient is seen as a matrix ``M`` of shape [groups, g_dim, a_dim] (rows:
output features, columns: input features plus a bias column). K-FAC approximates the Fisher
block of that matrix by ``A (x) G`` with ``A = E[a a^T]`` over the layer's inputs and
``G = E[g g^T]`` over the gradients of its outputs, so the preconditioned gradient is
``G^-1 M A^-1``.

Each adapter returns factor *sums* with a row count instead of means: a module used twice in
one forward pass, or over several accumulated micro-batches, then contributes exactly the
factor of all its rows. Output gradients are multiplied by the batch size so that G does not
depend on how a batch is split into per-worker shards: with a mean loss over b samples each
sample's output gradient carries 1/b, and b * (1/b) is the same on one worker with the whole
batch and on p workers with a shard each. The mean of the per-worker factors is then exactly
the factor of the whole batch (for equal shards).

Sums come out flat, in the layout they travel in (`plait.kfac.triangle`): packed upper
triangles computed as such, which halves the dominant cost of K-FAC on convolutions, or the
dense matrix when packing is off.

A layer that applies its weight at many positions of one sample (a convolution's spatial
positions, a linear layer's sequence positions) has two Kronecker approximations
(`Approximation`, Eschenhagen et al., NeurIPS 2023). *Expand* (KFC, Grosse and Martens
2016; the default) takes every position as a row. *Reduce* takes one row per sample: its
mean input and its summed output gradient, so ``g_row a_row^T`` is the sample's gradient
exactly when its inputs agree over positions. Reduce is what makes K-FAC affordable on
narrow convolutions, whose expand A factors cost more than the layers: on the digits CNN
(8 channels on 8x8 images) each A factor multiplies 2048 rows of 72-element patches, 9x
the convolution's own FLOPs. Reduced, the patches are averaged straight from a strided
view of the input (nothing is unfolded) and every factor has one row per sample; one
factor update of that CNN (one process, batch 32) fell from about 5.5 ms to 3.5 ms,
against a 3.3 ms SGD step, and the race to 97% took fewer steps
(benchmarks/race, "Time to accuracy" in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.kfac import triangle


class Approximation(StrEnum):
    """How a layer with positions per sample forms its factors (see the module docstring)."""

    EXPAND = "expand"  #: every position is a row
    REDUCE = "reduce"  #: one row per sample: the mean input, the summed output gradient


class FactorKind(StrEnum):
    """The two Kronecker factors of a layer, and EKFAC's statistic that travels with them."""

    A = "A"  # inputs (activations)
    G = "G"  # output gradients
    #: EKFAC's eigenvalue correction: the second moments of each row's gradient projected
    #: on the eigenbases, [groups, g_dim, a_dim] (`KFACLayer.scale_sum`)
    S = "S"


#: The Kronecker factors proper (what is decomposed and placed).
FACTORS = (FactorKind.A, FactorKind.G)


@dataclass(frozen=True, kw_only=True)
class FactorShape:
    """Shape of one factor: `groups` square blocks of side `dim`, or a diagonal; with
    `cols`, `groups` rectangular blocks [dim, cols] (EKFAC's statistic: never symmetric,
    never packed)."""

    dim: int
    groups: int = 1
    diagonal: bool = False
    cols: int | None = None

    @property
    def dense_numel(self) -> int:
        if self.diagonal:
            return self.dim
        return self.groups * self.dim * (self.dim if self.cols is None else self.cols)

    @property
    def packed_numel(self) -> int:
        """Elements of the upper triangles (what a symmetric factor needs on the wire)."""
        if self.diagonal or self.cols is not None:
            return self.dense_numel
        return self.groups * triangle.packed_numel(self.dim)

    @property
    def inverse_cost(self) -> float:
        """Relative cost of inverting or decomposing it: n^3 per block (n for a diagonal)."""
        return float(self.dim) if self.diagonal else float(self.groups) * float(self.dim) ** 3


#: A factor's sum over rows, flat in its wire layout (packed triangles, dense [groups, n, n]
#: or a diagonal [n]), and its row count.
FactorSum = tuple[torch.Tensor, int]


class KFACLayer(ABC):
    """Adapter between one module and the K-FAC math.

    Args:
        name: the module's qualified name in the model.
        module: the module (its weight, and bias if any, are preconditioned together).
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module

    @property
    @abstractmethod
    def a_shape(self) -> FactorShape: ...

    @property
    @abstractmethod
    def g_shape(self) -> FactorShape: ...

    def shape(self, kind: FactorKind) -> FactorShape:
        if kind is FactorKind.S:
            return FactorShape(dim=self.g_shape.dim, groups=self.g_shape.groups,
                               cols=self.a_shape.dim)  # fmt: skip
        return self.a_shape if kind is FactorKind.A else self.g_shape

    @abstractmethod
    def a_rows(self, inputs: torch.Tensor) -> torch.Tensor:
        """[groups, N, a_dim]: one row per sample (and position) the weight is applied to."""

    @abstractmethod
    def g_rows(self, grad_output: torch.Tensor, batch_size: int) -> torch.Tensor:
        """[groups, N, g_dim]: the output gradient of each row, times `batch_size`.

        Rows match `a_rows` one to one: ``g_rows^T a_rows / batch_size`` is the gradient.
        """

    #: Whether `Approximation.REDUCE` applies; False keeps a layer on expand whatever the
    #: config says (an embedding: its A is a diagonal of counts that a mean would fill in).
    reducible: bool = True

    def a_reduced(self, inputs: torch.Tensor, samples: int) -> torch.Tensor:
        """[groups, samples, a_dim]: each sample's mean row (K-FAC-reduce).

        This default averages `a_rows`, which must list each sample's rows together (every
        built-in adapter does); an adapter may override it with a cheaper computation.
        """
        return _per_sample(self.a_rows(inputs), samples).mean(2)

    def g_reduced(self, grad_output: torch.Tensor, batch_size: int) -> torch.Tensor:
        """[groups, batch_size, g_dim]: each sample's summed `g_rows` (K-FAC-reduce)."""
        return _per_sample(self.g_rows(grad_output, batch_size), batch_size).sum(2)

    def a_sum(
        self, inputs: torch.Tensor, *, packed: bool, reduce_to: int | None = None
    ) -> FactorSum:
        """Sum of ``a a^T`` over the rows of one forward input (`packed`: triangles);
        `reduce_to`: K-FAC-reduce over that many samples (one row each)."""
        rows = self.a_rows(inputs) if reduce_to is None else self.a_reduced(inputs, reduce_to)
        return _outer_sum(rows, packed=packed), rows.shape[1]

    def g_sum(
        self, grad_output: torch.Tensor, batch_size: int, *, packed: bool, reduce: bool = False
    ) -> FactorSum:
        """Sum of ``g g^T`` over the rows of one output gradient (`packed`: triangles);
        `reduce`: K-FAC-reduce (one row per sample of the `batch_size`)."""
        rows = (self.g_reduced if reduce else self.g_rows)(grad_output, batch_size)
        return _outer_sum(rows, packed=packed), rows.shape[1]

    def scale_sum(
        self,
        inputs: torch.Tensor,
        grad_output: torch.Tensor,
        batch_size: int,
        *,
        a_basis: torch.Tensor | None,
        g_basis: torch.Tensor,
        reduce: bool = False,
    ) -> FactorSum:
        """EKFAC's statistic: the sum over rows of ``(Q_G^T g)^2 (Q_A^T a)^2^T``, flat.

        Each row's gradient ``g a^T`` projected on the eigenbases is ``(Q_G^T g)(Q_A^T a)^T``,
        so its elementwise square is the outer product of the squared projections: the
        second moments of the projected gradient (George et al., 2018) cost two projections
        and one product, never a per-row gradient. `a_basis` None: the A side's basis is
        the identity (a diagonal factor). Rows as `a_sum` and `g_sum` form them.
        """
        a = self.a_reduced(inputs, batch_size) if reduce else self.a_rows(inputs)
        g = (self.g_reduced if reduce else self.g_rows)(grad_output, batch_size)
        a2 = (a if a_basis is None else torch.matmul(a, a_basis)).square()
        g2 = torch.matmul(g, g_basis).square()
        return torch.matmul(g2.transpose(-1, -2), a2).reshape(-1), a.shape[1]

    @abstractmethod
    def grad_matrix(self) -> torch.Tensor | None:
        """The gradient as [groups, g_dim, a_dim] (None when the weight has no gradient)."""

    @abstractmethod
    def set_grad_matrix(self, matrix: torch.Tensor) -> None:
        """Write a [groups, g_dim, a_dim] matrix back into the parameters' gradients."""

    def parameters(self) -> Iterator[nn.Parameter]:
        yield from self.module.parameters(recurse=False)

    @property
    def grad_numel(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, A={self.a_shape}, G={self.g_shape})"


def _per_sample(rows: torch.Tensor, samples: int) -> torch.Tensor:
    """[groups, N, n] rows, each sample's together, as [groups, samples, N / samples, n]."""
    groups, n, dim = rows.shape
    assert samples >= 1 and n % samples == 0, f"{n} rows do not split into {samples} samples"
    return rows.reshape(groups, samples, n // samples, dim)


def _batched(t: torch.Tensor) -> torch.Tensor:
    """A 2-d convolution's input or output gradient with its batch dimension ([C, H, W]: one)."""
    return t if t.dim() == 4 else t.unsqueeze(0)


def _outer_sum(rows: torch.Tensor, *, packed: bool) -> torch.Tensor:
    """``rows^T rows`` per group of [groups, N, n] rows, flat: packed triangles or dense."""
    if packed:
        return triangle.syrk(rows)
    return torch.matmul(rows.transpose(-1, -2), rows).reshape(-1)


def _with_ones(rows: torch.Tensor) -> torch.Tensor:
    """Append the homogeneous coordinate that carries the bias."""
    return torch.cat([rows, rows.new_ones(*rows.shape[:-1], 1)], dim=-1)


def _g_rows(grad: torch.Tensor, batch_size: int, groups: int) -> torch.Tensor:
    """[groups, N, c] rows of an output gradient laid out [N, groups * c], batch-scaled."""
    rows = grad * float(batch_size)
    return rows.reshape(rows.shape[0], groups, -1).transpose(0, 1)


class LinearLayer(KFACLayer):
    """``nn.Linear``, or any module computing ``y = x W^T + b`` on the last dimension of its
    first input, for inputs of any leading shape [..., in].

    Args:
        name: the module's qualified name.
        module: a module with a 2-D ``weight`` parameter and an optional ``bias``.
        transposed: the weight is stored [in, out] (``y = x W + b``, as Hugging Face's
            ``Conv1D``) instead of [out, in].

    Raises:
        ValueError: the module has no 2-D ``weight`` or a bias of the wrong size.
    """

    def __init__(self, name: str, module: nn.Module, *, transposed: bool = False) -> None:
        super().__init__(name, module)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(
                f"{name or '<root>'} ({type(module).__name__}) is not Linear-like: it needs a "
                "2-D weight parameter"
            )
        self.transposed = transposed
        out_f, in_f = weight.shape[::-1] if transposed else weight.shape
        self.in_features, self.out_features = int(in_f), int(out_f)
        bias = getattr(module, "bias", None)
        self.has_bias = isinstance(bias, torch.Tensor)
        if self.has_bias and bias.numel() != self.out_features:  # type: ignore[union-attr]
            raise ValueError(
                f"{name or '<root>'} ({type(module).__name__}): bias of "
                f"{bias.numel()} elements for {self.out_features} outputs"  # type: ignore[union-attr]
            )

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight  # type: ignore[return-value]

    @property
    def bias(self) -> torch.Tensor | None:
        return self.module.bias if self.has_bias else None  # type: ignore[return-value]

    def parameters(self) -> Iterator[nn.Parameter]:
        yield self.weight  # type: ignore[misc]
        if self.bias is not None:
            yield self.bias  # type: ignore[misc]

    @property
    def a_shape(self) -> FactorShape:
        return FactorShape(dim=self.in_features + int(self.has_bias))

    @property
    def g_shape(self) -> FactorShape:
        return FactorShape(dim=self.out_features)

    def a_rows(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, inputs.shape[-1])
        return (_with_ones(rows) if self.has_bias else rows).unsqueeze(0)

    def g_rows(self, grad_output: torch.Tensor, batch_size: int) -> torch.Tensor:
        return _g_rows(grad_output.reshape(-1, grad_output.shape[-1]), batch_size, 1)

    def a_reduced(self, inputs: torch.Tensor, samples: int) -> torch.Tensor:
        rows = inputs.reshape(samples, -1, inputs.shape[-1]).mean(1)
        return (_with_ones(rows) if self.has_bias else rows).unsqueeze(0)

    def g_reduced(self, grad_output: torch.Tensor, batch_size: int) -> torch.Tensor:
        rows = grad_output.reshape(batch_size, -1, grad_output.shape[-1]).sum(1)
        return _g_rows(rows, batch_size, 1)

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.weight.grad
        if w is None:
            return None
        if self.transposed:
            w = w.t()
        if self.bias is not None:
            b = torch.zeros_like(w[:, 0]) if self.bias.grad is None else self.bias.grad
            w = torch.cat([w, b.reshape(-1, 1)], dim=1)
        return w.unsqueeze(0)

    def set_grad_matrix(self, matrix: torch.Tensor) -> None:
        m = matrix[0]
        if self.bias is not None:
            _assign_grad(self.bias, m[:, -1])
            m = m[:, :-1]
        _assign_grad(self.weight, m.t() if self.transposed else m)


class Conv2dLayer(KFACLayer):
    """``nn.Conv2d`` with any stride, dilation, padding (and padding mode) and groups.

    Inputs are unfolded into patches exactly as the convolution sees them (padding applied
    with the module's own mode), so each spatial position is one row; with groups, each
    group is an independent block with its own pair of factors.
    """

    module: nn.Conv2d

    def __init__(self, name: str, module: nn.Conv2d) -> None:
        super().__init__(name, module)
        self.has_bias = module.bias is not None
        self.groups = module.groups
        kh, kw = module.kernel_size
        self.patch = module.in_channels // module.groups * kh * kw
        self._selection_cache: dict[tuple[Any, ...], torch.Tensor] = {}

    @property
    def a_shape(self) -> FactorShape:
        return FactorShape(dim=self.patch + int(self.has_bias), groups=self.groups)

    @property
    def g_shape(self) -> FactorShape:
        return FactorShape(dim=self.module.out_channels // self.groups, groups=self.groups)

    def _padded(self, inputs: torch.Tensor) -> torch.Tensor:
        """The input as the convolution sees it: batched, padded with the module's mode."""
        m = self.module
        x = _batched(inputs)
        pad = m._reversed_padding_repeated_twice
        if any(pad):
            mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
            x = F.pad(x, pad, mode=mode)
        return x

    def _patches(self, inputs: torch.Tensor) -> torch.Tensor:
        m = self.module
        cols = F.unfold(
            self._padded(inputs), m.kernel_size, dilation=m.dilation, padding=0, stride=m.stride
        )
        b, _, positions = cols.shape
        # [B, groups*patch, L] -> [groups, B*L, patch]
        cols = cols.view(b, self.groups, self.patch, positions).permute(1, 0, 3, 2)
        return cols.reshape(self.groups, b * positions, self.patch)

    def a_rows(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = self._patches(inputs)
        return _with_ones(rows) if self.has_bias else rows

    def g_rows(self, grad_output: torch.Tensor, batch_size: int) -> torch.Tensor:
        g = _batched(grad_output)
        rows = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])
        return _g_rows(rows, batch_size, self.groups)

    def a_reduced(self, inputs: torch.Tensor, samples: int) -> torch.Tensor:
        """Each sample's mean patch, without materialising the patches (`_patches` copies
        kernel-size times the input).

        Tap ``(i, j)`` of the mean patch averages, over the output positions, the input
        element that tap reads: a sum over a set of input rows and columns fixed by the
        kernel's geometry, so the taps are ``S_h^T x S_w / positions`` with 0/1 selection
        matrices over the unpadded input (zero padding adds nothing), that is one product
        of the flattened maps with ``kron(S_h, S_w) / positions`` ([H W, kh kw]). On the
        digits CNN's 8x8 maps a few microseconds, against 167 us a layer for averaging a
        strided view of the padded input, which stays for the other padding modes.
        """
        m = self.module
        x = _batched(inputs)
        if m.padding_mode == "zeros":
            b, c, h, w = x.shape
            taps = torch.matmul(x.reshape(b, c, h * w), self._selection_matrix(x))
        else:
            (kh, kw), (sh, sw), (dh, dw) = m.kernel_size, m.stride, m.dilation
            # [B, C, H', W', window_h, window_w], then the kernel's taps within each window
            view = self._padded(x).unfold(2, (kh - 1) * dh + 1, sh).unfold(3, (kw - 1) * dw + 1, sw)
            taps = view[..., ::dh, ::dw].mean(dim=(2, 3))
        rows = taps.reshape(samples, self.groups, self.patch).transpose(0, 1)
        return _with_ones(rows) if self.has_bias else rows

    def _selection_matrix(self, x: torch.Tensor) -> torch.Tensor:
        """``kron(S_h, S_w) / positions`` for an input of `x`'s size, cached per size."""
        key = (x.shape[-2], x.shape[-1], x.dtype, x.device)
        cached = self._selection_cache.get(key)
        if cached is None:
            (sel_h, out_h), (sel_w, out_w) = (
                self._selection(int(x.shape[-2 + axis]), axis, x) for axis in (0, 1)
            )
            cached = torch.kron(sel_h, sel_w) / (out_h * out_w)
            self._selection_cache[key] = cached
        return cached

    def _selection(self, n: int, axis: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """[n, kernel taps] along `axis` (0: height): entry ``(r, i)`` counts the output
        positions at which tap `i` reads input row `r`; and the number of positions."""
        m = self.module
        k, s, d = m.kernel_size[axis], m.stride[axis], m.dilation[axis]
        pad = m._reversed_padding_repeated_twice  # (left, right, top, bottom)
        before, after = (pad[2], pad[3]) if axis == 0 else (pad[0], pad[1])
        out = (n + before + after - (k - 1) * d - 1) // s + 1
        sel = torch.zeros(n, k, dtype=like.dtype, device=like.device)
        read = torch.arange(out, device=like.device) * s - before
        for i in range(k):
            r = read + i * d
            sel[r[(r >= 0) & (r < n)], i] = 1.0  # one position per row: s >= 1
        return sel, out

    def g_reduced(self, grad_output: torch.Tensor, batch_size: int) -> torch.Tensor:
        return _g_rows(_batched(grad_output).sum(dim=(2, 3)), batch_size, self.groups)

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.module.weight.grad
        if w is None:
            return None
        m = w.reshape(self.groups, w.shape[0] // self.groups, self.patch)
        if self.has_bias:
            b = self.module.bias.grad  # type: ignore[union-attr]
            b = torch.zeros_like(w[:, 0, 0, 0]) if b is None else b
            m = torch.cat([m, b.view(self.groups, -1, 1)], dim=2)
        return m

    def set_grad_matrix(self, matrix: torch.Tensor) -> None:
        weight = self.module.weight
        if self.has_bias:
            bias = self.module.bias
            assert bias is not None
            _assign_grad(bias, matrix[:, :, -1].reshape(-1))
            matrix = matrix[:, :, :-1]
        _assign_grad(weight, matrix.reshape(weight.shape))


class EmbeddingLayer(KFACLayer):
    """``nn.Embedding``: a one-hot input makes A diagonal (token frequencies).

    The weight is [num_embeddings, dim], so the gradient matrix is its transpose
    [1, dim, num_embeddings] (G side rows, A side columns) like every other layer.
    """

    module: nn.Embedding
    reducible = False

    @property
    def a_shape(self) -> FactorShape:
        return FactorShape(dim=self.module.num_embeddings, diagonal=True)

    @property
    def g_shape(self) -> FactorShape:
        return FactorShape(dim=self.module.embedding_dim)

    def a_rows(self, inputs: torch.Tensor) -> torch.Tensor:
        onehot = F.one_hot(inputs.reshape(-1), self.module.num_embeddings)
        return onehot.to(self.module.weight.dtype).unsqueeze(0)

    def a_sum(
        self, inputs: torch.Tensor, *, packed: bool, reduce_to: int | None = None
    ) -> FactorSum:
        """The diagonal of ``sum a a^T`` for one-hot rows: token counts (no one-hot built)."""
        assert reduce_to is None, "an embedding is not reducible"
        idx = inputs.reshape(-1)
        counts = torch.bincount(idx, minlength=self.module.num_embeddings)
        return counts.to(self.module.weight.dtype), idx.numel()

    def g_rows(self, grad_output: torch.Tensor, batch_size: int) -> torch.Tensor:
        return _g_rows(grad_output.reshape(-1, grad_output.shape[-1]), batch_size, 1)

    def scale_sum(
        self,
        inputs: torch.Tensor,
        grad_output: torch.Tensor,
        batch_size: int,
        *,
        a_basis: torch.Tensor | None,
        g_basis: torch.Tensor,
        reduce: bool = False,
    ) -> FactorSum:
        """A one-hot row projects on the identity basis as itself, so each row's squared
        projected gradient lands in its token's column (no one-hot matrix is built)."""
        assert not reduce and a_basis is None, "an embedding's A is a diagonal"
        idx = inputs.reshape(-1)
        g2 = torch.matmul(self.g_rows(grad_output, batch_size), g_basis).square()[0]
        total = g2.new_zeros(self.module.embedding_dim, self.module.num_embeddings)
        total.index_add_(1, idx, g2.t())
        return total.reshape(-1), idx.numel()

    def grad_matrix(self) -> torch.Tensor | None:
        w = self.module.weight.grad
        return None if w is None else w.t().unsqueeze(0)

    def set_grad_matrix(self, matrix: torch.Tensor) -> None:
        _assign_grad(self.module.weight, matrix[0].t())


def _assign_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = value.detach().clone().reshape(param.shape)
    else:
        param.grad.copy_(value.reshape(param.shape))


#: Builds the adapter of one module: ``adapter(qualified_name, module)``.
LayerAdapter = Callable[[str, nn.Module], KFACLayer]

#: Layer types registered with `register_layer_type`, consulted before the built-ins.
_LAYER_TYPES: dict[type[nn.Module], LayerAdapter] = {}


def register_layer_type(
    cls: type[nn.Module], adapter: LayerAdapter | None = None, *, transposed: bool = False
) -> None:
    """Teach K-FAC a layer type (for every `KFAC` built afterwards, in this process).

    A Linear-like module (one computing ``y = x W^T + b`` on the last dimension of its
    first input, with ``weight`` [out, in] and an optional ``bias`` [out]) needs only its
    class; ``transposed=True`` says the weight is stored [in, out] (``y = x W + b``)::

        plait.kfac.register_layer_type(MyLinear)
        plait.kfac.register_layer_type(MyConv1D, transposed=True)

    Anything else gives an `adapter`, a callable ``(name, module) -> KFACLayer`` (subclass
    `KFACLayer`: its A and G rows, its gradient as a matrix and back). Subclasses of `cls`
    are covered too; a later registration of the same class replaces the earlier one.
    Register in the training script before building `KFAC`: under torchrun, every rank
    runs it, so every rank registers the same layers.

    Raises:
        ValueError: `cls` is not an ``nn.Module`` subclass, or `adapter` is not callable.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"register_layer_type needs an nn.Module subclass, got {cls!r}")
    if adapter is not None and not callable(adapter):
        raise ValueError(f"the adapter for {cls.__name__} must be callable, got {adapter!r}")
    _LAYER_TYPES[cls] = adapter or functools.partial(LinearLayer, transposed=transposed)


def unregister_layer_type(cls: type[nn.Module]) -> None:
    """Forget a type given to `register_layer_type` (no error if it was not registered)."""
    _LAYER_TYPES.pop(cls, None)


def _registered(module: nn.Module) -> LayerAdapter | None:
    for cls in type(module).__mro__:
        adapter = _LAYER_TYPES.get(cls)
        if adapter is not None:
            return adapter
    # Hugging Face's Conv1D (GPT-2 family): a Linear with its weight stored [in, out].
    # Looked up where transformers defines it, only when transformers is imported: a
    # model holding one cannot exist otherwise, and plait does not depend on transformers.
    hf = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(hf, "Conv1D", None)
    if isinstance(conv1d, type) and isinstance(module, conv1d):
        return functools.partial(LinearLayer, transposed=True)
    return None


def make_layer(name: str, module: nn.Module) -> KFACLayer | None:
    """The adapter for `module`, or None when K-FAC cannot handle it.

    Registered types (`register_layer_type`) come first, then Hugging Face's ``Conv1D``,
    then the built-ins ``nn.Linear``, ``nn.Conv2d`` and (non-sparse) ``nn.Embedding``.
    """
    if not any(p.requires_grad for p in module.parameters(recurse=False)):
        return None
    adapter = _registered(module)
    if adapter is not None:
        return adapter(name, module)
    if isinstance(module, nn.Linear):
        return LinearLayer(name, module)
    if isinstance(module, nn.Conv2d):
        return Conv2dLayer(name, module)
    if isinstance(module, nn.Embedding) and not module.sparse:  # sparse gradients: no
        return EmbeddingLayer(name, module)
    return None
