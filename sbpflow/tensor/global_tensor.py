"""GlobalTensor: a logical tensor laid out over a placement by an nd-sbp.

Each rank holds its local shard (docs/design.md: the local-shard rule); a rank outside
the placement holds an empty tensor. Autograd runs on the local shards; boxing steps are
autograd Functions with dual backward, so ``x.grad`` of a tensor laid out as ``s`` is laid out
as ``dual(s)``.

Here: the class, the remaking and writing through of its views, plain torch tensors lifted
(`lift`), and the dispatch `apply_op`: the class's methods run ops, and the dispatch makes
tensors and remakes stale views, so these stay in one module. What a view remembers is in
tensor/views.py, the creation ops in tensor/creation.py, the hooks in tensor/hooks.py.
"""

from __future__ import annotations

import functools
import math
import _weakrefset
import numbers
import sys
import weakref
from operator import attrgetter
from typing import Sequence

import torch

from .. import comm as _comm
from ..boxing import empty_local, plan_layouts, run_plan
from ..errors import (DtypeMismatchError, GraphError, IndexOutOfRange, PlacementError,
                      PlacementMismatchError, SbpError, SbpParseError, ShapeError, SignatureError,
                      UnsupportedTorchFunction)
from ..ops import TensorMeta, choose, detaches, get_op, hashable
from ..ops.shape import encode_index, list_index, resolve_shape, squeeze_dims
from ..placement import Placement
from ..sbp import (B, SbpLike, check_axes, dual_nd, format_nd_sbp, holds_value, parse_nd_sbp,
                   shard_box)
from ..utils import rebuild_sequence
from .dispatch_records import (_CHOICES, _Boxed, _Entry, _autocast_dtype, _check_dtypes,
                               _connected_empty, _describe, _intern_layout, _rank_context,
                               _same_trace)
from .hooks import _RESPLITS, _torch_dispatch, _tracing, _watch_resplit
from .views import (_axis_slice, _pieces, _reshaped, _stale, _strided, _swapped, _take,
                    _version, _viewed, copy_view, is_view)

__all__ = ["GlobalTensor", "retains_grads", "apply_op", "cat", "UnsupportedTorchFunction", "lift",
           "is_view", "copy_view", "numpy_names"]


def _layout(placement: Placement | None, sbp: SbpLike | None, ndim: int,
            shape: tuple) -> tuple[Placement, tuple]:
    """Fill defaults (all ranks, 1-D; broadcast), parse the sbp and check it."""
    world = _comm.world_size()
    if placement is None:
        placement = Placement("cpu", list(range(world)))
    if not isinstance(placement, Placement):
        raise PlacementError(f"expected an sf.placement, got {placement!r}")
    placement.check_world(world)
    nd = (B,) * placement.ndim if sbp is None else _parse_for(sbp, placement, shape)
    check_axes(nd, ndim, shape=shape, placement=placement)
    return placement, nd


def _parse_for(sbp: SbpLike, placement: Placement, shape: Sequence[int]) -> tuple:
    """``sbp`` parsed as the nd-sbp of a tensor of ``shape`` on ``placement``; a parse error
    (e.g. one sbp per mesh dim not given) names the tensor's shape and the placement."""
    try:
        return parse_nd_sbp(sbp, placement.ndim)
    except SbpParseError as exc:
        raise SbpParseError(f"{exc} (tensor of shape {tuple(shape)} on {placement})") from None


# -- method bindings: each a thin call of a registered op (bound in the class body below) -------
def _binary(name: str, reflected: bool = False):
    def method(self, other):
        return apply_op(name, other, self) if reflected else apply_op(name, self, other)
    method.__name__ = method.__qualname__ = name
    return method


# The weak dicts and sets of the standard library compare two references to one live key by
# comparing the key with itself (``p == p``); their lookups must stay identity tests (several
# modules keep WeakKeyDictionaries of parameters). Only those frames get a Python bool.
_WEAK_FILES = frozenset({weakref.__file__, _weakrefset.__file__})


_NUMBERS = (int, float, bool, complex)


def _compare(name: str):
    """``==`` / ``!=`` as torch's: elementwise against a tensor or a number; anything else
    (None, a string, a module) is not comparable, so Python falls back to identity. A key
    compared with itself by a weak dict's lookup is an identity test (`_WEAK_FILES`)."""
    def method(self, other):
        if other is self and sys._getframe(1).f_code.co_filename in _WEAK_FILES:
            return name == "eq"
        if isinstance(other, (GlobalTensor, torch.Tensor)) or type(other) in _NUMBERS:
            return apply_op(name, self, other)
        if isinstance(other, numbers.Number):  # numpy's scalars: as Python's numbers
            return apply_op(name, self, other.item() if hasattr(other, "item") else
                            complex(other) if isinstance(other, numbers.Complex) and
                            not isinstance(other, numbers.Real) else float(other))
        return NotImplemented
    method.__name__ = method.__qualname__ = f"__{name}__"
    return method


# torch's argument parser takes numpy's names for these (``x.sum(axis=1, keepdims=True)``)
_NUMPY_NAMES = {"axis": "dim", "keepdims": "keepdim"}


def numpy_names(kwargs: dict) -> dict:
    """``kwargs`` with numpy's ``axis`` / ``keepdims`` renamed ``dim`` / ``keepdim``, as torch's
    C functions and Tensor methods take them."""
    if "axis" not in kwargs and "keepdims" not in kwargs:
        return kwargs
    return {_NUMPY_NAMES.get(k, k): v for k, v in kwargs.items()}


def _unary(name: str):
    def method(self, *args, **kwargs):
        return apply_op(name, self, *args, **numpy_names(kwargs))
    method.__name__ = method.__qualname__ = name
    return method


def _shape_args(shape) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) \
        else tuple(shape)


class GlobalTensor:
    """A logical tensor: ``shape``, ``dtype``, ``placement``, ``sbp`` (tuple), and ``local``.

    Create one with `randn`, `zeros`, `tensor`, `from_local`, ...; change its layout with
    `to_global`; read it whole with `full_tensor`.
    """

    # ``_key``: an int naming (shape, dtype, nd-sbp), set on first dispatch (see `_layout_key`);
    # ``_boxes``: the versions of this tensor ops boxed it to (see `_boxed_for_op`), or None;
    # ``_view``: for a view (a slice, reshape, transpose, ... of another tensor) its `_View`
    __slots__ = ("_local", "_shape", "_placement", "_sbp", "_key", "_boxes", "_view",
                 "__weakref__")

    def __init__(self, local: torch.Tensor, shape: Sequence[int], placement: Placement,
                 sbp: tuple) -> None:
        self._local = local
        self._shape = tuple(int(s) for s in shape)
        self._placement = placement
        self._sbp = tuple(sbp)
        self._key = None
        self._boxes = None
        if type(self) is GlobalTensor:  # a subclass's instances are never views (see below)
            self._view = None
        if _tracing.recorder is not None:  # made outside the ops: the graph cannot replay it
            _tracing.recorder.made(local)

    def __init_subclass__(cls, **kwargs) -> None:
        """Instances of subclasses (parameters, gradients, pending means) are never views:
        their ``_view`` reads None even when a subclass fills the slots itself."""
        super().__init_subclass__(**kwargs)
        cls._view = None

    # -- torch functions (sbpflow/nn/torch_functions.py) ----------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.*`` / ``torch.nn.functional.*`` / Tensor methods called with a global tensor
        run as sbpflow ops, or raise `UnsupportedTorchFunction` naming what to use instead."""
        return _torch_dispatch(func, args, kwargs or {})

    # read by torch.typename: torch.optim's refusal of these tensors then says why (an instance
    # property: the class's own __name__ stays "GlobalTensor")
    __name__ = property(lambda self: (
        f"{type(self).__name__} (an sbpflow global tensor: torch.optim updates torch tensors "
        f"only; use sf.optim.AdamW, Adam or SGD, which take these)"))

    # -- metadata ----------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self._shape[dim]

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def dim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return math.prod(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        return self._local.device

    # read-only, and as cheap as reading the slot (a getter in C): the other modules read a
    # tensor's layout and stored shard through these, never through the private slots
    placement = property(attrgetter("_placement"), doc="The placement (an `sf.placement`).")
    sbp = property(attrgetter("_sbp"), doc="The nd-sbp: a tuple, one sbp per mesh dim.")
    shard = property(attrgetter("_local"), doc=(
        "This rank's shard as stored: what `local` returns, except that a view whose base "
        "changed since is not remade first (the framework's layers read this: a graph's "
        "recorder, optimizers); a ZeRO shard in flight is still waited for."))

    @property
    def local(self) -> torch.Tensor:
        """This rank's shard (empty on a rank outside the placement)."""
        if self._view is not None:
            _fresh(self)
        return self._local

    def to_local(self) -> torch.Tensor:
        return self.local

    @property
    def is_local_rank(self) -> bool:
        """Whether this rank is in the placement."""
        return _comm.rank() in self._placement

    # -- layout ------------------------------------------------------------------------------
    def to_global(self, placement: Placement | None = None,
                  sbp: SbpLike | None = None) -> "GlobalTensor":
        """The same logical tensor in another layout (boxing: least communication, planned
        then run; differentiable). Omitted arguments keep the current ones."""
        if self._view is not None:
            _fresh(self)
        dst_pl = self._placement if placement is None else placement
        if not isinstance(dst_pl, Placement):
            raise PlacementError(f"to_global: expected an sf.placement, got {dst_pl!r}")
        if sbp is None:
            if dst_pl.ndim != self._placement.ndim:
                raise SbpError(f"to_global: {dst_pl} has {dst_pl.ndim} mesh dims but the sbp "
                               f"{format_nd_sbp(self._sbp)} of the tensor of shape {self._shape} "
                               f"has {len(self._sbp)}; give sbp=")
            sbp = self._sbp
        dst_pl.check_world(_comm.world_size())
        dst_sbp = _parse_for(sbp, dst_pl, self._shape)
        check_axes(dst_sbp, self.ndim, shape=self._shape, placement=dst_pl)
        if dst_pl == self._placement and dst_sbp == self._sbp:
            return self
        plan = plan_layouts(self._shape, self.dtype, self._placement, self._sbp, dst_pl, dst_sbp)
        out = GlobalTensor(run_plan(plan, self._local), self._shape, dst_pl, dst_sbp)
        if _tracing.recorder is not None:
            _tracing.recorder.box(plan, self, out)
        return out

    def full_tensor(self) -> torch.Tensor:
        """The logical value, as a plain torch tensor, on every rank of the world."""
        world = _comm.world_size()
        pl = self._placement
        if sorted(pl.flat_ranks) == list(range(world)):
            return self.to_global(sbp=(B,) * pl.ndim)._local
        everyone = Placement(pl.device_type, list(range(world)))
        return self.to_global(everyone, B)._local

    # -- autograd ----------------------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        if self._view is not None:
            _fresh(self)
        return self._local.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        """``p.requires_grad = False``, as torch: `requires_grad_` (which a subclass, such as
        a parameter, may extend)."""
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad: bool = True) -> "GlobalTensor":
        self._local.requires_grad_(requires_grad)
        return self

    @property
    def is_leaf(self) -> bool:
        return self._local.is_leaf

    @property
    def grad(self) -> "GlobalTensor | None":
        """The gradient, laid out as ``dual(sbp)`` (a B tensor's gradient is P, and so on)."""
        if _tracing.recorder is not None:  # backward is recorded, not run, while tracing
            raise GraphError(f"graph: build reads .grad of the tensor of {_describe(self)}; a "
                             f"graph runs backward after build, so its gradients are not there "
                             f"yet (read them after the call)")
        g = self._local.grad
        if g is None:
            return None
        return _Grad(g, self._shape, self._placement, dual_nd(self._sbp))

    @grad.setter
    def grad(self, value: "GlobalTensor | None") -> None:
        self._local.grad = None if value is None else value._local

    def retain_grad(self) -> None:
        """Keep this non-leaf tensor's gradient in ``.grad`` after backward (torch's)."""
        self._local.retain_grad()
        # (by identity: a weak set compares torch tensors with ==, elementwise, and a second
        # call on the same tensor raised)
        _comm.current().per_rank.retained_grads[self._local] = True

    def detach(self) -> "GlobalTensor":
        """The same values without autograd history: a view, as torch's (an in-place op on it
        changes this tensor's values, and it reads them after one on this tensor)."""
        if self._view is not None:
            _fresh(self)
        out = GlobalTensor(self._local.detach(), self._shape, self._placement, self._sbp)
        if _tracing.recorder is not None:
            _tracing.recorder.detach(self, out)
        return _viewed(out, self, "detach", None)

    @property
    def data(self) -> "GlobalTensor":
        """``x.data``: `detach` (a view: in-place ops on it change ``x``'s values)."""
        return self.detach()

    @data.setter
    def data(self, value) -> None:
        raise UnsupportedTorchFunction(
            f"x.data = value on the tensor of {_describe(self)}: torch makes x share value's "
            f"storage; sbpflow does not rebind a shard. Write the values with "
            f"`with torch.no_grad(): x.copy_(value)` (same shape), or rebind the name (a "
            f"module's parameter: assign an sf.nn.Parameter)")

    def backward(self, gradient: "GlobalTensor | None" = None, retain_graph: bool = False) -> None:
        """Backpropagate from this tensor; every rank of the world must call it.

        Without ``gradient`` the tensor must be a scalar; the seed is the logical value 1 in
        layout ``dual(sbp)``: for a P loss every rank seeds 1, for a B loss the first rank of
        each group seeds 1 and the others 0.
        """
        if self._view is not None:
            _fresh(self)
        seed = self._seed(gradient)
        if not self._local.requires_grad:
            raise SbpError(f"backward: the tensor of {_describe(self)} does not require grad "
                           f"(as torch: no input of it requires grad, or it was detached)")
        if _tracing.recorder is not None:  # a graph runs it at replay, per micro-batch
            _tracing.recorder.backward(self, seed)
            return
        torch.autograd.backward(self._local, seed, retain_graph=retain_graph)

    def _seed(self, gradient: "GlobalTensor | None") -> torch.Tensor:
        """This rank's shard of the backward seed: ``gradient`` (or the logical 1 of a scalar)
        laid out as ``dual(sbp)``."""
        dual = dual_nd(self._sbp)
        if gradient is None:
            if self._shape != ():
                raise ShapeError(f"backward() without a gradient needs a scalar; this tensor has "
                                 f"shape {self._shape}, placement {self._placement}, sbp "
                                 f"{format_nd_sbp(self._sbp)}")
            dtype = self.dtype  # the logical 1 (`sf.ones`)
            one = _create((), self._placement, dual, dtype, False,
                          lambda box: torch.full((), 1.0, dtype=dtype))
            return one._local.to(self.device)
        if gradient.shape != self.shape:
            raise ShapeError(f"backward: the gradient has shape {tuple(gradient.shape)} but the "
                             f"tensor has shape {self._shape} (gradient: {_describe(gradient)}; "
                             f"tensor: {_describe(self)})")
        return gradient.to_global(self._placement, dual)._local.to(self.device)

    # -- ops: operators and methods (each name a registered op of sbpflow.ops) -------------------
    __add__, __radd__ = _binary("add"), _binary("add", True)
    __sub__, __rsub__ = _binary("sub"), _binary("sub", True)
    __mul__, __rmul__ = _binary("mul"), _binary("mul", True)
    __truediv__, __rtruediv__ = _binary("div"), _binary("div", True)
    __pow__, __rpow__ = _binary("pow"), _binary("pow", True)
    __floordiv__, __rfloordiv__ = _binary("floor_divide"), _binary("floor_divide", True)
    __mod__, __rmod__ = _binary("remainder"), _binary("remainder", True)
    floor_divide, remainder = _binary("floor_divide"), _binary("remainder")
    __matmul__, __rmatmul__ = _binary("matmul"), _binary("matmul", True)
    __lt__, __le__, __gt__, __ge__ = _binary("lt"), _binary("le"), _binary("gt"), _binary("ge")
    # ``==`` / ``!=`` are elementwise, as torch's; a tensor still hashes by identity (dicts,
    # sets and weak dicts of tensors find a key by identity first, so they never compare)
    __eq__, __ne__ = _compare("eq"), _compare("ne")
    __hash__ = object.__hash__
    mul, pow = _binary("mul"), _binary("pow")

    def div(self, other, *, rounding_mode: str | None = None) -> "GlobalTensor":
        """torch's: ``rounding_mode`` None (true division), ``"trunc"`` or ``"floor"``."""
        if rounding_mode is None:
            return apply_op("div", self, other)
        if rounding_mode in ("floor", "trunc"):   # (a zero gradient for floats, as torch's)
            if not self.dtype.is_floating_point:
                return apply_op("floor_divide", self, other) if rounding_mode == "floor" \
                    else apply_op("div", self, other).to(self.dtype)
            return apply_op(rounding_mode, apply_op("div", self, other))
        raise ValueError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' "
                         f"but found {rounding_mode!r} (as torch)")

    def add(self, other, *, alpha=1) -> "GlobalTensor":
        """``self + alpha * other``, as torch's (``x.add_(y, alpha=0.1)``: an EMA update)."""
        return apply_op("add", self, other if alpha == 1 else other * alpha)

    def sub(self, other, *, alpha=1) -> "GlobalTensor":
        return apply_op("sub", self, other if alpha == 1 else other * alpha)

    def __abs__(self) -> "GlobalTensor":
        return apply_op("abs", self)

    def __float__(self) -> float:
        """``float(loss)``: `item` (collective: every rank calls it)."""
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        """An integer tensor of one element as an index (``x[:, :n]``, ``range(n)``), as torch:
        `item` (collective)."""
        if self.dtype.is_floating_point or self.dtype.is_complex or self.numel() != 1:
            raise TypeError(f"only integer tensors of a single element can be converted to an "
                            f"index (as torch); this one has {_describe(self)}")
        return int(self.item())
    matmul, maximum, minimum = _binary("matmul"), _binary("maximum"), _binary("minimum")
    eq, ne, lt, le, gt, ge = (_binary(n) for n in ("eq", "ne", "lt", "le", "gt", "ge"))
    # torch's bitwise operators: bitwise on integers, logical on bools, torch's type promotion
    __and__, __rand__ = _binary("bitwise_and"), _binary("bitwise_and", True)
    __or__, __ror__ = _binary("bitwise_or"), _binary("bitwise_or", True)
    __xor__, __rxor__ = _binary("bitwise_xor"), _binary("bitwise_xor", True)
    __lshift__, __rlshift__ = _binary("bitwise_left_shift"), _binary("bitwise_left_shift", True)
    __rshift__, __rrshift__ = _binary("bitwise_right_shift"), _binary("bitwise_right_shift", True)
    __invert__ = bitwise_not = _unary("bitwise_not")
    __neg__ = _unary("neg")
    exp, log, sqrt, rsqrt, abs = (_unary(n) for n in ("exp", "log", "sqrt", "rsqrt", "abs"))
    sin, cos, tanh, sigmoid, relu = (_unary(n) for n in ("sin", "cos", "tanh", "sigmoid", "relu"))
    square, reciprocal, neg = _unary("square"), _unary("reciprocal"), _unary("neg")
    round, floor, ceil, trunc, sign = (_unary(n) for n in ("round", "floor", "ceil", "trunc",
                                                           "sign"))
    log1p, expm1 = _unary("log1p"), _unary("expm1")
    def clamp(self, min=None, max=None) -> "GlobalTensor":
        """torch's: ``min`` / ``max`` numbers (one op), or tensors (elementwise bounds: a
        ``maximum`` then a ``minimum``, so each bound is an input with its own layout; a
        plain torch tensor is lifted by `apply_op`)."""
        if isinstance(min, (GlobalTensor, torch.Tensor)) or \
                isinstance(max, (GlobalTensor, torch.Tensor)):
            out = self
            if min is not None:
                out = apply_op("maximum", out, min)
            if max is not None:
                out = apply_op("minimum", out, max)
            return out
        return apply_op("clamp", self, min=min, max=max)
    clip = clamp

    def clamp_min(self, min) -> "GlobalTensor":
        return self.clamp(min=min)

    def clamp_max(self, max) -> "GlobalTensor":
        return self.clamp(max=max)
    clone = _unary("clone")
    isnan, logical_not = _unary("isnan"), _unary("logical_not")
    amax, amin = _unary("amax"), _unary("amin")

    def sum(self, *args, dtype: torch.dtype | None = None, **kwargs) -> "GlobalTensor":
        """torch's, ``dtype`` included (the tensor is cast first, as torch accumulates in it)."""
        return apply_op("sum", self if dtype is None else self.to(dtype), *args,
                        **numpy_names(kwargs))

    def mean(self, *args, dtype: torch.dtype | None = None, **kwargs) -> "GlobalTensor":
        return apply_op("mean", self if dtype is None else self.to(dtype), *args,
                        **numpy_names(kwargs))

    def max(self, *args, **kwargs):
        """``x.max()``: the largest entry. With a dim, torch's (values, indices); with a tensor,
        the elementwise maximum (sbpflow/nn/torch_handlers.py, as ``torch.max``)."""
        if not args and not kwargs:
            return apply_op("amax", self)
        return _torch_dispatch(torch.Tensor.max, (self,) + args, kwargs)

    def min(self, *args, **kwargs):
        """``x.min()``: the smallest entry; otherwise as `max`."""
        if not args and not kwargs:
            return apply_op("amin", self)
        return _torch_dispatch(torch.Tensor.min, (self,) + args, kwargs)
    softmax, log_softmax = _unary("softmax"), _unary("log_softmax")

    # -- views: as torch's, each remembers what it views (`_viewed`; see `_View`) ---------------
    def reshape(self, *shape) -> "GlobalTensor":
        """``reshape`` / ``view``: a ``-1`` is resolved here from the logical shape. A view
        where torch's would be one (`_reshaped`), else a new tensor."""
        out = apply_op("reshape", self, shape=resolve_shape(self.numel(), _shape_args(shape)))
        return _reshaped(self, out)

    view = reshape

    def flatten(self, *args, **kwargs) -> "GlobalTensor":
        return _reshaped(self, apply_op("flatten", self, *args, **kwargs))

    def unsqueeze(self, *args, **kwargs) -> "GlobalTensor":
        out = apply_op("unsqueeze", self, *args, **kwargs)
        return _viewed(out, self, "reshape", out._shape)

    def squeeze(self, dim=None) -> "GlobalTensor":
        """Only the given axes (all if None) of logical size 1 are removed."""
        out = apply_op("squeeze", self, dim=squeeze_dims(self._shape, dim))
        return _viewed(out, self, "reshape", out._shape)

    def contiguous(self, memory_format=None) -> "GlobalTensor":
        """This tensor when torch's would be contiguous (a tensor that is not a view is), else
        a copy, as torch."""
        if self._view is None or _strided(self).is_contiguous():
            return self
        return apply_op("contiguous", self)

    def transpose(self, dim0: int, dim1: int) -> "GlobalTensor":
        out = apply_op("transpose", self, dim0, dim1)
        return _viewed(out, self, "permute", _swapped(len(self._shape), dim0, dim1))

    def permute(self, *dims) -> "GlobalTensor":
        dims = _shape_args(dims)
        out = apply_op("permute", self, dims=dims)
        return _viewed(out, self, "permute", tuple(d % self.ndim for d in dims))

    def t(self) -> "GlobalTensor":
        return self.transpose(0, 1) if self.ndim > 1 else \
            _viewed(apply_op("reshape", self, shape=self._shape), self, "reshape", self._shape)

    @property
    def T(self) -> "GlobalTensor":
        return self.permute(*reversed(range(self.ndim)))

    def expand(self, *shape) -> "GlobalTensor":
        out = apply_op("expand", self, shape=_shape_args(shape))
        return _viewed(out, self, "expand", out._shape)

    def narrow(self, dim: int, start: int, length: int) -> "GlobalTensor":
        """torch's ``narrow``; ``start`` may be a 0-d tensor, as in torch (its value is read:
        a collective for a global one)."""
        if isinstance(start, (torch.Tensor, GlobalTensor)):
            start = int(start.item())
        out = apply_op("narrow", self, dim, start, length)
        d = dim % max(self.ndim, 1)
        begin = start + self._shape[d] if start < 0 else start
        return _viewed(out, self, "index", _axis_slice(d, begin, begin + length))

    def __getitem__(self, index) -> "GlobalTensor":
        """Basic indexing is a view, as torch's; one list of ints (``x[:, [-1]]``) a copy."""
        try:
            encoded = encode_index(index)
        except SbpError:  # again, naming the tensor (described only when needed: it costs)
            listed = list_index(index, self._shape)
            if listed is not None:  # one list of ints: basic indexing, then index_select
                basic, dim, picks = listed
                return apply_op("index_select", self[basic], dim=dim, index=picks)
            if _advanced(index):  # torch's advanced indexing (sbpflow/nn/torch_indexing.py)
                return _torch_dispatch(torch.Tensor.__getitem__, (self, index), {})
            encoded = encode_index(index, f"indexing a tensor of {_describe(self)}")
        return _viewed(apply_op("getitem", self, index=encoded), self, "index", encoded)

    def __setitem__(self, index, value) -> None:
        """``x[index] = value`` for a basic index or a bool mask over leading axes: this tensor
        takes the new value (an in-place op: `_assign_`), as torch."""
        self._assign_(_set_items(self, index, value))

    def split(self, split_size, dim: int = 0):
        if _RESPLITS and self._sbp:
            _watch_resplit(self, dim)
        return _pieces(self, apply_op("split", self, split_size=split_size, dim=dim), dim)

    def chunk(self, chunks: int, dim: int = 0):
        if _RESPLITS and self._sbp:
            _watch_resplit(self, dim)
        return _pieces(self, apply_op("chunk", self, chunks=chunks, dim=dim), dim)

    def to(self, *args, **kwargs) -> "GlobalTensor":
        """``to(dtype)``, ``to(device)``, ``to(device, dtype)``, ``to(other)``, ``to(dtype=...)``
        as torch: the dtype is cast shard by shard; a device of the placement's device type is
        where the shards already are. Moving to another device type is ``to_global`` onto a
        placement of that type (`UnsupportedTorchFunction` here). ``non_blocking`` means nothing
        here; ``copy=True`` returns a copy."""
        dtype = _to_dtype(self, args, kwargs)
        flags = [a for a in args if type(a) is bool]  # non_blocking, copy (positional)
        copy = flags[1] if len(flags) > 1 else kwargs.get("copy", False)
        if dtype is None or dtype == self.dtype:  # (a global tensor has no memory format)
            return apply_op("clone", self) if copy else self
        return apply_op("to_dtype", self, dtype=dtype)

    # -- in-place ops (torch's semantics: the tensor object takes the new value) ----------------
    def _assign_(self, result: "GlobalTensor", fresh: bool = True) -> "GlobalTensor":
        """Make this tensor hold ``result`` (same logical shape), as torch's in-place ops do.

        A view writes through to the tensor it views (`_write_back`); the other views of that
        tensor read the new value when next used (`_View`). A parameter or a gradient (shards
        that optimizers and gradient buckets hold), and any other tensor outside the autograd
        graph whose shard is its own storage, keeps its shard object and layout: ``result`` is
        boxed to it and copied in. A tensor in the autograd graph (not a leaf, grad enabled),
        or one whose shard is a torch view of another's storage, takes ``result``'s shard and
        layout (no copy; backward is ``result``'s). A leaf that requires grad under grad mode
        raises, as torch. ``fresh=False``: ``result`` may be held elsewhere (``copy_``'s
        source), so it is copied before this tensor takes its shard."""
        if result is self:
            return self
        if not isinstance(result, GlobalTensor):
            raise UnsupportedTorchFunction(f"in-place op on the tensor of {_describe(self)} "
                                           f"produced {type(result).__name__}")
        if result._shape != self._shape:
            raise ShapeError(f"in-place op: the result has shape {result._shape} but the "
                             f"tensor it writes into has {_describe(self)} (torch: output "
                             f"shape doesn't match the broadcast shape)")
        if result.dtype != self.dtype:
            result = result.to(self.dtype)
        local = self._local
        takes = self._view is not None or (
            torch.is_grad_enabled() and local.requires_grad and not local.is_leaf) or (
            local._base is not None and type(self) is GlobalTensor and not local.requires_grad) \
            or local.is_inference()
        rec = _tracing.recorder
        if not takes:
            src = result.to_global(self._placement, self._sbp)
            if rec is not None:   # a graph replays the write (and undoes the trace's)
                rec.assign(self, src)
            local.copy_(src._local)
            return self
        if not fresh:
            result = apply_op("clone", result)
        if self._view is not None:
            _write_back(self, result)
        else:
            if rec is not None:
                rec.check_taken(self)
            _take(self, result)
        return self

    def __iadd__(self, other):
        return self._assign_(apply_op("add", self, other))

    def __isub__(self, other):
        return self._assign_(apply_op("sub", self, other))

    def __imul__(self, other):
        return self._assign_(apply_op("mul", self, other))

    def __itruediv__(self, other):
        return self._assign_(apply_op("div", self, other))

    def _assign_bitwise_(self, name: str, other) -> "GlobalTensor":
        """``&=`` ``|=`` ``^=`` ``<<=`` ``>>=``: as torch, refused where the result's dtype
        cannot be cast to this tensor's (``bool_mask &= long_tensor``)."""
        result = apply_op(name, self, other)
        if not torch.can_cast(result.dtype, self.dtype):
            raise DtypeMismatchError(f"result type {result.dtype} can't be cast to the desired "
                                     f"output type {self.dtype} (as torch; {_describe(self)})")
        return self._assign_(result)

    def __iand__(self, other):
        return self._assign_bitwise_("bitwise_and", other)

    def __ior__(self, other):
        return self._assign_bitwise_("bitwise_or", other)

    def __ixor__(self, other):
        return self._assign_bitwise_("bitwise_xor", other)

    def __ilshift__(self, other):
        return self._assign_bitwise_("bitwise_left_shift", other)

    def __irshift__(self, other):
        return self._assign_bitwise_("bitwise_right_shift", other)

    def float(self, memory_format=None) -> "GlobalTensor":
        return self.to(torch.float32)

    def double(self, memory_format=None) -> "GlobalTensor":
        return self.to(torch.float64)

    def item(self):
        """The value of a one-element tensor (collective: every rank calls it)."""
        if self.numel() != 1:  # before the collective: every rank raises the same
            raise ShapeError(f"item(): a tensor with {self.numel()} elements cannot be converted "
                             f"to a number (as torch); this one has {_describe(self)}")
        return self.full_tensor().item()

    # -- display -----------------------------------------------------------------------------
    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f"GlobalTensor(shape={self._shape}, dtype={dt}, placement={self._placement}, "
                f"sbp={format_nd_sbp(self._sbp)}, local_shape={tuple(self._local.shape)}{grad})")

    def __bool__(self) -> bool:
        """The truth of a one-element tensor (collective, as `item`); torch refuses others."""
        if self.numel() != 1:
            raise ShapeError(f"Boolean value of a tensor with {self.numel()} elements is "
                             f"ambiguous (as torch); this one has {_describe(self)}")
        return bool(self.item())

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d global tensor")
        return self._shape[0]

    def __iter__(self):
        """The slices along axis 0, as torch (a 0-d tensor is not iterable)."""
        if not self._shape:
            raise TypeError(f"iteration over a 0-d tensor (as torch; tensor of "
                            f"{_describe(self)})")
        return iter([self[i] for i in range(self._shape[0])])

    def __contains__(self, element) -> bool:
        """``element in x``: whether some entry equals it (a collective, as `item`), as torch."""
        if not isinstance(element, (GlobalTensor, torch.Tensor, numbers.Number)):
            raise UnsupportedTorchFunction(
                f"'in' on a global tensor takes a tensor or a number, got "
                f"{type(element).__name__} (tensor of {_describe(self)})")
        return bool((self == element).any())


class _Grad(GlobalTensor):
    """``x.grad``: a global tensor over the gradient's shard. In-place ops write into that
    shard (`GlobalTensor._assign_`): backward accumulates into it and gradient buckets hold it."""

    __slots__ = ()


# -- views: remade, and written through, by running ops (records: tensor/views.py) ---------
# kind -> (op, its attribute): how a view is made again from its (current) parent
_REMAKE = {"reshape": ("reshape", "shape"), "permute": ("permute", "dims"),
           "index": ("getitem", "index"), "expand": ("expand", "shape")}


def _fresh(t: GlobalTensor) -> None:
    """Remake the view ``t`` from its parent if the parent changed since `_View` says."""
    if not _stale(t):
        return
    v = t._view
    if v.kind == "detach":
        new = v.parent.detach()
    elif v.kind == "copy":
        new = _viewed(v.arg[0](v.parent), v.parent, v.kind, v.arg)
    else:
        op, attr = _REMAKE[v.kind]
        new = _viewed(apply_op(op, v.parent, **{attr: v.arg}), v.parent, v.kind, v.arg)
    _take(t, new)
    t._view = new._view


def _write_back(t: GlobalTensor, result: GlobalTensor) -> None:
    """An in-place op on the view ``t``, as torch's: its parent takes its own value with
    ``t``'s region replaced by ``result`` (an in-place op on the parent, so up the chain of
    views), then ``t`` takes ``result``. Through ``detach`` the values are written without
    autograd, as torch writes a detached view's storage."""
    v = t._view
    if v.kind == "copy":
        raise UnsupportedTorchFunction(v.arg[1])
    parent = v.parent
    if parent._view is not None:
        _fresh(parent)
    if v.kind == "detach":
        with torch.no_grad():
            parent._assign_(result.detach())
        new = parent.detach()
        _take(t, new)
        t._view = new._view
        return
    parent._assign_(_UNDO[v.kind](parent, v.arg, result, t))
    _take(t, result)
    local = parent._local
    t._view = v._replace(local=local, version=_version(local), key=result._key)


def _unpermute(parent: GlobalTensor, dims: tuple, r: GlobalTensor, t) -> GlobalTensor:
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d] = i
    return apply_op("permute", r, dims=tuple(inverse))


def _unexpand(parent: GlobalTensor, shape: tuple, r: GlobalTensor, t) -> GlobalTensor:
    k = len(shape) - parent.ndim
    if any(n > 1 for n in shape[:k]) or any(
            parent._shape[i] == 1 and shape[k + i] > 1 for i in range(parent.ndim)):
        raise UnsupportedTorchFunction(
            f"in-place op on an expanded tensor (shape {parent._shape} expanded to {shape}): "
            f"several of its elements are one element of the tensor it views, so torch "
            f"refuses it too ('more than one element of the written-to tensor refers to a "
            f"single memory location'); clone() it first (tensor of {_describe(parent)})")
    return apply_op("reshape", r, shape=parent._shape)


# kind -> fn(parent, arg, result, view): the parent's new value after writing ``result``
_UNDO = {
    "reshape": lambda parent, arg, r, t: apply_op("reshape", r, shape=parent._shape),
    "permute": _unpermute,
    "index": lambda parent, index, r, t: apply_op("setitem", parent, r, index=index),
    "expand": _unexpand,
}


def _advanced(index) -> bool:
    """``index`` holds tensors, lists or bools: torch's advanced indexing."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(it, (GlobalTensor, torch.Tensor, list, bool)) for it in items)


def _set_items(x: GlobalTensor, index, value) -> GlobalTensor:
    """The value of ``x`` after ``x[index] = value``: a basic index (the ``setitem`` op), or a
    bool mask over leading axes (``where``); other advanced indices are refused."""
    pl = x._placement
    if isinstance(value, torch.Tensor):
        value = lift(value, pl)
    elif not isinstance(value, GlobalTensor):
        value = lift(torch.as_tensor(value, dtype=x.dtype), pl)
    if isinstance(index, (GlobalTensor, torch.Tensor)) and index.dtype == torch.bool:
        return _masked_set(x, index, value)
    try:
        encoded = encode_index(index, f"x[...] = value on a tensor of {_describe(x)}")
    except SbpError:
        raise UnsupportedTorchFunction(
            f"x[{index!r}] = value on the tensor of {_describe(x)}: item assignment takes a "
            f"basic index (ints, slices, None, ...) or a bool mask over leading axes; for "
            f"other advanced indices build the new value with torch.where(mask, value, x) "
            f"(a mask from comparisons with torch.arange), which this tensor can then take "
            f"with x.copy_(...)") from None
    return apply_op("setitem", x, value, index=encoded)


def _masked_set(x: GlobalTensor, mask, value: GlobalTensor) -> GlobalTensor:
    """``x[mask] = value``, with ``mask`` over the leading axes of ``x`` and ``value`` one
    entry or a tensor of the trailing axes: ``torch.where(mask, value, x)``."""
    if isinstance(mask, torch.Tensor):
        mask = lift(mask, x._placement)
    k = mask.ndim
    if tuple(mask.shape) != x._shape[:k]:
        raise ShapeError(f"x[mask] = value: a mask of shape {tuple(mask.shape)} does not match "
                         f"the leading axes of the tensor of {_describe(x)} (as torch)")
    trailing = x.ndim - k
    if value.ndim == trailing + 1 and value.shape[0] == 1:
        value = value.reshape(tuple(value.shape[1:]))
    if value.ndim > trailing:
        raise UnsupportedTorchFunction(
            f"x[mask] = values with one row per selected entry (values of shape "
            f"{tuple(value.shape)}) on the tensor of {_describe(x)}: the number of rows depends "
            f"on the mask's values; lay the values out like x and use torch.where(mask, "
            f"values, x)")
    cond = mask.reshape(*mask.shape, *(1,) * trailing) if trailing else mask
    return apply_op("where", cond, value.to(x.dtype), x)


def _to_dtype(t: GlobalTensor, args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype a ``to(...)`` call asks for (None: keep); refuses another device type."""
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif type(a) is bool:  # non_blocking, copy (`GlobalTensor.to`)
            continue
        elif isinstance(a, (GlobalTensor, torch.Tensor)):
            dtype = a.dtype
            device = a.device
        elif isinstance(a, (str, torch.device, int)):
            device = a
        else:
            raise UnsupportedTorchFunction(f"to({a!r}): expected a dtype, a device or a tensor "
                                           f"(tensor of {_describe(t)})")
    if device is not None:
        kind = torch.device(device).type if not isinstance(device, int) else "cuda"
        if kind != t._placement.device_type:
            raise UnsupportedTorchFunction(
                f"to({device!r}): the tensor of {_describe(t)} lives on "
                f"{t._placement.device_type} devices; move it with .to_global(placement="
                f"sf.placement({kind!r}, ranks)) (a placement names the devices)")
    return dtype


# -- plain torch tensors mixed with global ones ------------------------------------------------
def lift(value: torch.Tensor, placement: Placement) -> GlobalTensor:
    """A plain torch tensor taken as replicated on ``placement`` (every rank of it holds the
    whole value, which must be the same on every rank: a mask, positions, a constant); in a
    graph's build, a constant of the graph. One that requires grad (a torch parameter left in
    a model) is refused: convert the model."""
    if value.requires_grad:
        raise UnsupportedTorchFunction(
            f"a plain torch tensor of shape {tuple(value.shape)} that requires grad (a torch "
            f"parameter?) is mixed with global tensors on {placement}; convert its module with "
            f"sf.nn.from_torch (or sf.parallel.apply), or wrap it with sf.tensor / "
            f"sf.nn.Parameter")
    device = _device(placement)
    if value.is_meta:  # made on an input's device while sf.auto.trace runs on shapes
        device = value.device
    local = value.to(device) if _comm.rank() in placement else \
        empty_local(value.dtype, device)
    out = GlobalTensor(local, tuple(value.shape), placement, (B,) * placement.ndim)
    if _tracing.recorder is not None:  # a graph constant, as sf.tensor(value) in build is
        _tracing.recorder.constant(out)
    return out


def lift_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each plain torch tensor, also inside a list or tuple,
    lifted (`lift`) onto the placement of the first global tensor among them; unchanged when
    there is none of either. What a torch function or an ``sf.nn.functional`` function does
    with a mask, a target or positions given as plain torch tensors."""
    if not any(_holds_plain(a) for a in (*args, *kwargs.values())):
        return args, kwargs
    pl = next((t._placement for a in (*args, *kwargs.values()) for t in _members(a)
               if isinstance(t, GlobalTensor)), None)
    if pl is None:
        return args, kwargs
    return (tuple(_lifted(a, pl) for a in args),
            {k: _lifted(v, pl) for k, v in kwargs.items()})


def lifting_plain_tensors(fn):
    """``fn`` (a function of global tensors, e.g. ``sf.nn.functional.cross_entropy``) taking
    plain torch tensors among its arguments too, lifted by `lift_arguments`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args, kwargs = lift_arguments(args, kwargs)
        return fn(*args, **kwargs)
    return wrapper


def _members(value) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _holds_plain(value) -> bool:
    return any(isinstance(v, torch.Tensor) for v in _members(value))


def _lifted(value, pl: Placement):
    if isinstance(value, (list, tuple)):
        if not _holds_plain(value):
            return value
        return rebuild_sequence(value, [_lifted(v, pl) for v in value])
    return lift(value, pl) if isinstance(value, torch.Tensor) else value


def _lift_args(args: tuple) -> tuple | None:
    """``args`` with each plain torch tensor lifted (`lift`) onto the placement of the first
    global tensor; None when there is nothing to lift."""
    pl = next((a._placement for a in args if isinstance(a, GlobalTensor)), None)
    if pl is None or not any(isinstance(a, torch.Tensor) for a in args):
        return None
    return tuple(lift(a, pl) if isinstance(a, torch.Tensor) else a for a in args)


def _torch_method(func, name: str):
    def method(self, *args, **kwargs):
        return _torch_dispatch(func, (self,) + args, kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"torch.Tensor.{name} on a global tensor (sbpflow/nn/torch_functions.py)."
    method.torch_stub = True
    return method


def _bind_torch_methods(cls: type) -> None:
    """Give ``cls`` each public ``torch.Tensor`` method and property it does not define, as a
    call of `__torch_function__` (class attributes, not a ``__getattr__``: one on the class
    would slow every attribute read of a global tensor, the dispatch's included)."""
    for name in dir(torch.Tensor):
        if name.startswith("_") or hasattr(cls, name):
            continue
        attr = getattr(torch.Tensor, name)
        setattr(cls, name, _torch_method(attr, name) if callable(attr) else property(
            lambda self, attr=attr: _torch_dispatch(attr, (self,), {}),
            doc=f"torch.Tensor.{name} of a global tensor (sbpflow/nn/torch_functions.py)."))


_bind_torch_methods(GlobalTensor)


def retains_grads() -> bool:
    """Whether a tensor of this rank called `GlobalTensor.retain_grad` and is still alive."""
    return bool(_comm.current().per_rank.retained_grads)


# -- creation ------------------------------------------------------------------------------------
def _device(placement: Placement) -> torch.device:
    return _comm.current().device(placement.device_type)


def _create(shape: tuple, placement, sbp, dtype, requires_grad: bool, make) -> GlobalTensor:
    """Build a tensor whose holding ranks get ``make(box, coord)`` for their region."""
    placement, nd = _layout(placement, sbp, len(shape), shape)
    dtype = dtype or torch.get_default_dtype()
    device = _device(placement)
    me = _comm.rank()
    if me in placement:
        coord = placement.coord_of(me)
        box = shard_box(shape, placement.shape, nd, coord)
        if holds_value(nd, coord):
            local = make(box).to(dtype=dtype, device=device)
        else:
            local = torch.zeros(tuple(n for _, n in box), dtype=dtype, device=device)
    else:
        local = empty_local(dtype, device)
    out = GlobalTensor(local.requires_grad_(requires_grad), shape, placement, nd)
    if _tracing.recorder is not None:  # made from its arguments alone: a graph constant
        _tracing.recorder.constant(out)
    return out


# -- dispatch ------------------------------------------------------------------------------------
def apply_op(name: str, *args, sbp: Sequence | None = None, **attrs):
    """Run registered op ``name`` on global tensors (and constants) in ``args``.

    Chooses the signature whose boxing of the inputs moves the fewest bytes (cached), boxes the
    inputs, runs the kernel on the local shards, and wraps the outputs. ``sbp=`` forces the
    inputs' layouts (one nd-sbp or None per tensor input). All tensor inputs must share one
    placement: moving a tensor to another placement is an explicit ``to_global``. A plain torch
    tensor among ``args`` is taken as replicated on that placement (`lift`).
    """
    try:
        key, tensors, pl, grad, attrs_key, forced = _dispatch_key(name, args, sbp, attrs)
    except SignatureError:
        lifted = _lift_args(args)  # plain torch tensors: taken as replicated (`lift`)
        if lifted is None:
            raise
        return apply_op(name, *lifted, sbp=sbp, **attrs)
    entry = _CHOICES.get(key)
    if entry is None:
        pinned = tuple(t._local.requires_grad and t._local.is_leaf for t in tensors)
        entry = _CHOICES.put(key, _choice_entry(name, args, tensors, pl, attrs_key, forced,
                                                grad, pinned))
    if entry.mixed:
        _check_dtypes(name, tensors, pl)
    boxed = [t if t._sbp == nd else _boxed_for_op(t, nd)
             for t, nd in zip(tensors, entry.choice.ins)] if entry.moves else tensors
    comm = _rank_local.comm or _comm.current()
    comm.activity.op = name  # what a timeout report says this rank did last (memory only)
    me = comm.rank
    if me in pl._index:
        return _run_kernel(entry, args, boxed, tensors, pl, me, attrs)
    choice = entry.choice
    dtype = _autocast_dtype(name, pl)
    locals_ = tuple(_connected_empty(boxed, dtype or m.dtype) for m in choice.out_metas)
    out = _wrap_outputs(entry, locals_, pl, len(locals_) > 1)
    if _tracing.recorder is not None:  # an op of another placement: kept for the logical graph
        _tracing.recorder.op(entry, args, boxed, None, attrs, out, pl)
    return out


def _boxed_for_op(t: GlobalTensor, nd: tuple) -> GlobalTensor:
    """``t`` laid out as ``nd`` for an op: boxed once for all the consumers that need that
    layout while ``t`` is alive and unchanged (docs/internals.md, 'Boxing once for all
    consumers'); backward then runs the dual boxing once, on the summed gradient."""
    local = t._local
    boxes = t._boxes
    if boxes is not None:
        hit = boxes.get(nd)
        if hit is not None and hit.source() is local and hit.version == _version(local) and \
                hit.grad == torch.is_grad_enabled() and _same_trace(hit.trace):
            shard = hit.kept if hit.kept is not None else hit.ref()
            if shard is not None:
                return _wrap(shard, t._shape, t._placement, nd)
    out = t.to_global(sbp=nd)
    if boxes is None:
        boxes = t._boxes = {}
    parameter = local.requires_grad and local.is_leaf
    boxes[nd] = _Boxed(weakref.ref(local), _version(local), torch.is_grad_enabled(),
                       None if parameter else out._local, weakref.ref(out._local),
                       None if _tracing.recorder is None else weakref.ref(_tracing.recorder))
    return out


def _dispatch_key(name: str, args: tuple, sbp, attrs: dict) -> tuple:
    """The dispatch cache key of a call, and what building it found: (key, tensor inputs,
    their placement, whether some input needs grad, the attributes' key, forced layouts).

    Per tensor the key holds its layout id (negated for a leaf that requires grad: a parameter,
    whose layout the choice avoids moving); constants are (type, value) tuples, so a constant
    never equals a layout id (and 1 and 1.0, which give different dtypes, differ)."""
    tensors, parts = [], [name]
    grad = False
    pl = None
    for a in args:
        if isinstance(a, GlobalTensor):
            k = a._key or _layout_key(a)  # (a view keeps no key: made fresh there first)
            local = a._local
            tensors.append(a)
            if local.requires_grad:
                grad = True
                if local.is_leaf:
                    k = -k
            parts.append(k)
            if pl is None:
                pl = a._placement
            elif a._placement is not pl and a._placement != pl:
                raise PlacementMismatchError(
                    f"{name}: inputs are on different placements: {_describe(tensors[0])} and "
                    f"{_describe(a)}; move one with .to_global(placement=...) first (this is "
                    f"where a pipeline stage boundary goes)")
        else:
            parts.append((type(a), hashable(a)))
    if pl is None:
        raise SignatureError(f"{name}: needs at least one global tensor input")
    grad = grad and torch.is_grad_enabled()
    attrs_key = tuple(sorted((k, hashable(v)) for k, v in attrs.items())) if attrs else ()
    forced = None
    if sbp is not None:
        forced = tuple(None if s is None else parse_nd_sbp(s, pl.ndim) for s in sbp)
    parts += (pl, attrs_key, forced, grad)
    return tuple(parts), tensors, pl, grad, attrs_key, forced


def _run_kernel(entry: _Entry, args: tuple, boxed: list, tensors: list, pl: Placement,
                me: int, attrs: dict):
    """Run the op's kernel on this rank's shards of the (boxed) inputs; wrap the outputs."""
    choice, op = entry.choice, entry.op
    if len(boxed) == len(args):
        local_args = [t._local for t in boxed]
    else:
        it = iter(boxed)
        local_args = [next(it)._local if isinstance(a, GlobalTensor) else a for a in args]
    if op.context:
        ctx = entry.contexts.get(me) or _rank_context(entry, tensors, pl, me)
        attrs = dict(attrs)
        attrs["ctx"] = ctx
    result = op.kernel(*local_args, **attrs)
    multi = isinstance(result, (tuple, list))
    if not multi and not entry.detach:  # the common case: one output
        meta = choice.out_metas[0]
        out = _wrap(result, meta.shape, pl, choice.outs[0],
                    entry.out_keys[0] if result.dtype is meta.dtype else None)
    else:
        out = _wrap_outputs(entry, tuple(result) if multi else (result,), pl, multi)
    if _tracing.recorder is not None:
        _tracing.recorder.op(entry, args, boxed, local_args, attrs, out, pl)
    return out


def _wrap_outputs(entry: _Entry, locals_: tuple, pl: Placement, multi: bool):
    """Global tensors of the local outputs (detached where the outputs carry no gradient)."""
    choice = entry.choice
    if entry.detach:
        locals_ = tuple(t.detach() for t in locals_)
    outs = tuple(_wrap(t, m.shape, pl, nd, k if t.dtype is m.dtype else None)
                 for t, m, nd, k in zip(locals_, choice.out_metas, choice.outs, entry.out_keys))
    return outs if multi else outs[0]


_rank_local = _comm.rank_local()


def _wrap(local: torch.Tensor, shape: tuple, placement: Placement, sbp: tuple,
          key: int | None = None) -> GlobalTensor:
    """`GlobalTensor` from already-normalised metadata (the dispatch's hot path); ``key`` is
    its `_layout_key` when the caller knows it."""
    t = object.__new__(GlobalTensor)
    t._local, t._shape, t._placement, t._sbp, t._key = local, shape, placement, sbp, key
    t._boxes = t._view = None
    return t


def _layout_key(t: GlobalTensor) -> int:
    """``t``'s layout id, kept in ``t._key``. A view keeps none, so that the dispatch, which
    reads ``_key`` first, comes here on every use of one and remakes it if its base changed
    (`_fresh`): the check costs the tensors that are not views nothing."""
    if t._view is not None:
        _fresh(t)
        return t._view.key or _intern_layout(t._shape, t._local.dtype, t._sbp)
    t._key = key = _intern_layout(t._shape, t._local.dtype, t._sbp)
    return key


def _choice_entry(name, args, tensors, pl, attrs_key, forced, grad, pinned) -> tuple:
    meta_args = tuple(TensorMeta(a._shape, a.dtype) if isinstance(a, GlobalTensor)
                      else hashable(a) for a in args)
    try:
        choice = choose(name, meta_args, tuple(t._sbp for t in tensors), pl, attrs_key, forced,
                        grad, pinned)
    except (ShapeError, IndexOutOfRange) as exc:  # said with shapes only: add the layouts
        shown = "; ".join(_describe(t) for t in tensors)
        raise type(exc)(f"{exc} [inputs: {shown}]") from None
    out_keys = tuple(_intern_layout(m.shape, m.dtype, nd)
                     for m, nd in zip(choice.out_metas, choice.outs))
    moves = any(t._sbp != nd for t, nd in zip(tensors, choice.ins))
    op = get_op(name)
    mixed = op.same_dtype and len({t.dtype for t in tensors}) > 1
    return _Entry(choice, op, detaches(choice.outs), out_keys, moves, {}, mixed)


def cat(tensors: Sequence[GlobalTensor], dim: int = 0) -> GlobalTensor:
    """``torch.cat`` of global tensors on one placement (``dim`` must not be split: a split
    there is boxed first)."""
    tensors = list(tensors)
    if not tensors or not all(isinstance(t, GlobalTensor) for t in tensors):
        raise SignatureError(f"cat: needs a non-empty sequence of global tensors, got "
                             f"{[type(t).__name__ for t in tensors]}")
    return apply_op("cat", *tensors, dim=dim)

