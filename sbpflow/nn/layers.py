"""The common layers of ``sf.nn`` on global tensors: `Linear`, `Embedding`, `LayerNorm`,
`Dropout`, the activations, `Conv2d` and the pools, `Flatten`, `CrossEntropyLoss`, and the
containers `Sequential`, `ModuleList`, `ModuleDict` (the `Module` they build on is in
`modules.py`; norm layers other than `LayerNorm` in `norm.py`).

Each layer takes ``placement=`` and ``sbp=`` (its weight's layout; default: every rank,
replicated) and initialises its parameters as torch does, from layout-independent random
streams. See docs/internals.md, 'Modules'.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Iterable

import torch

from ..errors import ShapeError
from ..placement import Placement
from ..sbp import Broadcast, Partial, shard_box
from ..tensor import GlobalTensor
from ..tensor import zeros as _sf_zeros
from . import functional as F
from . import functional_conv as FC
from . import init
from .modules import Module
from .parameter import Parameter

__all__ = ["Linear", "Embedding", "LayerNorm", "Dropout", "GELU", "ReLU", "Tanh", "Sigmoid",
           "SiLU", "Identity", "Softmax", "CrossEntropyLoss", "Conv2d", "MaxPool2d", "AvgPool2d",
           "AdaptiveAvgPool2d", "Flatten", "Sequential", "ModuleList", "ModuleDict"]


def _param(shape, placement, sbp, dtype) -> Parameter:
    if init.is_meta_init():   # no storage: see sf.nn.init.meta_init
        return Parameter(init.meta_tensor(shape, placement, sbp, dtype))
    return Parameter(_sf_zeros(*shape, placement=placement, sbp=sbp, dtype=dtype))


def _follow_out_axis(weight: Parameter) -> tuple:
    """A bias's layout given its weight's: split where the weight's output axis (0) is split,
    replicated where the weight is split on an input axis, partial where it is partial."""
    return tuple(s if isinstance(s, (Broadcast, Partial)) else
                 (s if s.axis == 0 else Broadcast()) for s in weight.sbp)


class Linear(Module):
    """``y = x @ weight.T + bias``; weight (out_features, in_features). Initialised as torch
    (weight: kaiming-uniform with ``a=sqrt(5)``, i.e. U(-1/sqrt(in), 1/sqrt(in)); bias the same
    bound). ``sbp`` is the weight's layout; the bias follows the weight's output axis unless
    ``bias_sbp`` is given."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 placement: Placement | None = None, sbp=None, *, bias_sbp=None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = _param((out_features, in_features), placement, sbp, dtype)
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if bias:
            bsbp = _follow_out_axis(self.weight) if bias_sbp is None else bias_sbp
            self.bias = _param((out_features,), self.weight.placement, bsbp, dtype)
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
            init.uniform_(self.bias, -bound, bound)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Embedding(Module):
    """A lookup table (num_embeddings, embedding_dim), initialised N(0, 1) as torch, the
    ``padding_idx`` row zero."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 placement: Placement | None = None, sbp=None, *,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ShapeError(f"Embedding: padding_idx {padding_idx} must be within "
                                 f"[-{num_embeddings}, {num_embeddings})")
            padding_idx = padding_idx % num_embeddings
        self.padding_idx = padding_idx
        self.weight = _param((num_embeddings, embedding_dim), placement, sbp, dtype)
        init.normal_(self.weight)
        if padding_idx is not None:
            _zero_row(self.weight, padding_idx)

    def forward(self, ids: GlobalTensor) -> GlobalTensor:
        return F.embedding(ids, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}"


def _zero_row(w: GlobalTensor, row: int) -> None:
    from .. import comm as _comm
    if w.local.is_meta:
        init.record(w, lambda t: _zero_row(t, row))
        return
    me = _comm.rank()
    if me not in w.placement:
        return
    (start, size), *_ = shard_box(tuple(w.shape), w.placement.shape, w.sbp,
                                  w.placement.coord_of(me))
    if start <= row < start + size:
        with torch.no_grad():
            w.local[row - start].zero_()


class LayerNorm(Module):
    """torch's ``nn.LayerNorm`` on global tensors: normalised over the last
    ``len(normalized_shape)`` axes, with an affine ``weight`` and ``bias``
    (``elementwise_affine=True``). A split normalised axis costs a reduction across its
    ranks."""
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, placement: Placement | None = None, sbp=None, *,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        ns = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape = tuple(int(n) for n in ns)
        self.eps, self.elementwise_affine = float(eps), elementwise_affine
        if elementwise_affine:
            self.weight = _param(self.normalized_shape, placement, sbp, dtype)
            init.ones_(self.weight)
            if bias:
                self.bias = _param(self.normalized_shape, self.weight.placement,
                                   self.weight.sbp, dtype)
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class Dropout(Module):
    """Dropout with sbpflow's layout-independent mask (`sf.nn.functional.dropout`); identity in
    eval mode."""

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = float(p), inplace

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return F.dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class _Activation(Module):
    _fn = None

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return type(self)._fn(x)


class ReLU(_Activation):
    """torch's ``nn.ReLU``, elementwise: any layout."""
    _fn = staticmethod(F.relu)

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace


class Tanh(_Activation):
    """torch's ``nn.Tanh``, elementwise: any layout."""
    _fn = staticmethod(F.tanh)


class Sigmoid(_Activation):
    """torch's ``nn.Sigmoid``, elementwise: any layout."""
    _fn = staticmethod(F.sigmoid)


class SiLU(_Activation):
    """torch's ``nn.SiLU``, elementwise: any layout."""
    _fn = staticmethod(F.silu)


class GELU(Module):
    """torch's ``nn.GELU`` (``approximate='none'`` or ``'tanh'``), elementwise: any layout."""
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Identity(Module):
    """torch's ``nn.Identity``: returns its input (arguments of the constructor are ignored, as
    torch's)."""
    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    def forward(self, x):
        return x


class Softmax(Module):
    """torch's ``nn.Softmax(dim)``; along a split axis the max and the sum are reduced across its
    ranks."""
    def __init__(self, dim: int = -1) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return F.softmax(x, self.dim)


class CrossEntropyLoss(Module):
    """``F.cross_entropy`` as a module (torch's shapes: classes on axis 1); ``weight``: an
    optional global (C,) tensor of class weights, kept as a buffer as torch does."""

    def __init__(self, weight: GlobalTensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing = label_smoothing

    def forward(self, input: GlobalTensor, target: GlobalTensor) -> GlobalTensor:
        return F.cross_entropy(input, target, self.weight, self.ignore_index, self.reduction,
                               self.label_smoothing)


def _pair(v) -> tuple:
    return (int(v), int(v)) if isinstance(v, int) else tuple(int(a) for a in v)


class Conv2d(Module):
    """2-D convolution; weight (out, in/groups, kH, kW) and bias initialised as torch
    (U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in/groups * kH * kW). Zero padding only."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 placement: Placement | None = None, sbp=None, *, bias_sbp=None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if padding_mode != "zeros":
            raise NotImplementedError(f"Conv2d: padding_mode {padding_mode!r} is not supported "
                                      f"(only 'zeros')")
        if in_channels % groups or out_channels % groups:
            raise ShapeError(f"Conv2d: in_channels {in_channels} and out_channels "
                             f"{out_channels} must be divisible by groups {groups}")
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size, self.stride = _pair(kernel_size), stride
        self.padding, self.dilation, self.groups = padding, dilation, int(groups)
        shape = (out_channels, in_channels // groups) + self.kernel_size
        self.weight = _param(shape, placement, sbp, dtype)
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if bias:
            fan_in, _ = init.fan_in_and_fan_out(shape)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            bsbp = _follow_out_axis(self.weight) if bias_sbp is None else bias_sbp
            self.bias = _param((out_channels,), self.weight.placement, bsbp, dtype)
            init.uniform_(self.bias, -bound, bound)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return FC.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                         self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}")


class MaxPool2d(Module):
    """torch's ``nn.MaxPool2d`` on global (N, C, H, W) tensors, batch or channels split."""
    def __init__(self, kernel_size, stride=None, padding=0, dilation=1,
                 return_indices: bool = False, ceil_mode: bool = False) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.return_indices, self.ceil_mode = dilation, return_indices, ceil_mode

    def forward(self, x: GlobalTensor):
        return FC.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation,
                             self.ceil_mode, self.return_indices)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool2d(Module):
    """torch's ``nn.AvgPool2d`` on global (N, C, H, W) tensors, batch or channels split."""
    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None) -> None:
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad
        self.divisor_override = divisor_override

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return FC.avg_pool2d(x, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                             self.count_include_pad, self.divisor_override)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool2d(Module):
    """torch's ``nn.AdaptiveAvgPool2d(output_size)`` on global (N, C, H, W) tensors."""
    def __init__(self, output_size) -> None:
        super().__init__()
        self.output_size = output_size

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return FC.adaptive_avg_pool2d(x, self.output_size)


class Flatten(Module):
    """Merge dims ``start_dim..end_dim`` (the ``flatten`` op: a split on a merged axis is kept
    when it is the leading merged axis, else boxed)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return x.flatten(self.start_dim, self.end_dim)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


# -- containers -----------------------------------------------------------------------------------
class _ModuleSequence(Module):
    """What `Sequential` and `ModuleList` share: sub-modules numbered in order."""

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module: Module) -> "_ModuleSequence":
        self.add_module(str(len(self)), module)
        return self


class Sequential(_ModuleSequence):
    """Modules applied in order; ``Sequential(OrderedDict(name=module, ...))`` names them."""

    def __init__(self, *args) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], (OrderedDict, dict)):
            for name, m in args[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(args):
                self.add_module(str(i), m)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, idx):
        mods = list(self._modules.items())
        if isinstance(idx, slice):
            return Sequential(OrderedDict(mods[idx]))
        return mods[idx][1]


class ModuleList(_ModuleSequence):
    """torch's ``nn.ModuleList``: a list of modules, registered as children ``0``, ``1``, ..."""
    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        for m in modules or ():
            self.append(m)

    def _index(self, idx: int) -> str:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"index {idx} is out of range for a ModuleList of {n}")
        return str(idx % n)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return ModuleList(list(self._modules.values())[idx])
        return self._modules[self._index(idx)]

    def __setitem__(self, idx: int, module: Module) -> None:
        self.add_module(self._index(idx), module)


    def extend(self, modules: Iterable[Module]) -> "ModuleList":
        """Append every module of ``modules``; returns this list."""
        for m in modules:
            self.append(m)
        return self


class ModuleDict(Module):
    """torch's ``nn.ModuleDict``: modules by name, registered as children in insertion order."""
    def __init__(self, modules=None) -> None:
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def keys(self):
        """The names, in order."""
        return self._modules.keys()

    def values(self):
        """The modules, in order."""
        return self._modules.values()

    def items(self):
        """``(name, module)`` pairs, in order."""
        return self._modules.items()

    def update(self, modules) -> None:
        """Add (or replace) the modules of ``modules`` (a mapping or ``(name, module)`` pairs)."""
        items = modules.items() if hasattr(modules, "items") else modules
        for k, m in items:
            self.add_module(k, m)
