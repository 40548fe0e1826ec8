"""GlobalTensor's operators and torch-like methods: each a thin call of a registered op
(arithmetic, comparisons, math, reductions), its views (reshape, permute, indexing, split,
...; what they remember: tensor/views.py), item assignment, ``to``, the in-place operators, and
a call of `__torch_function__` for every other public ``torch.Tensor`` method.

They run ops through the dispatch, which imports the class, so the class cannot define them
itself: they are written here in the namespace `_OpMethods` and attached to it by
`_set_methods(GlobalTensor)` in tensor/__init__.py (as JAX's array_methods.py does).
"""

from __future__ import annotations

import _weakrefset
import numbers
import sys
import weakref

import torch

from ..errors import DtypeMismatchError, SbpError, ShapeError, UnsupportedTorchFunction
from ..ops.shape import encode_index, list_index, resolve_shape, squeeze_dims
from .dispatch import apply_op
from .dispatch_records import _describe
from .global_tensor import GlobalTensor
from .hooks import _torch_dispatch
from .mixing import lift
from .resplits import _RESPLITS, _watch_resplit
from .views import _axis_slice, _pieces, _reshaped, _strided, _swapped, _viewed

__all__ = ["numpy_names"]


# -- method bindings: each a thin call of a registered op (bound in `_OpMethods` below) ----
def _binary(name: str, reflected: bool = False):
    def method(self, other):
        return apply_op(name, other, self) if reflected else apply_op(name, self, other)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"torch's ``{name}`` of this tensor and ``other`` (a global tensor, a torch " \
        f"tensor taken as replicated, or a number): the op {name!r}, its layout chosen by the " \
        "dispatch (docs/design.md, 'The dispatch: signatures as data')."
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
    method.__doc__ = f"torch's ``Tensor.{name}``, with its arguments: the op {name!r} on the " \
        "local shards, its layout chosen by the dispatch."
    return method


def _shape_args(shape) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) \
        else tuple(shape)


class _OpMethods:
    """The namespace of GlobalTensor's op methods (never instantiated): `_set_methods` copies
    every name defined here onto the class."""

    __slots__ = ()

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
        """torch's ``sub(other, alpha=1)``: ``self - alpha * other``."""
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
        """``clamp(min=min)``: the elementwise maximum with ``min``."""
        return self.clamp(min=min)

    def clamp_max(self, max) -> "GlobalTensor":
        """``clamp(max=max)``: the elementwise minimum with ``max``."""
        return self.clamp(max=max)
    clone = _unary("clone")
    isnan, logical_not = _unary("isnan"), _unary("logical_not")
    amax, amin = _unary("amax"), _unary("amin")

    def sum(self, *args, dtype: torch.dtype | None = None, **kwargs) -> "GlobalTensor":
        """torch's, ``dtype`` included (the tensor is cast first, as torch accumulates in it)."""
        return apply_op("sum", self if dtype is None else self.to(dtype), *args,
                        **numpy_names(kwargs))

    def mean(self, *args, dtype: torch.dtype | None = None, **kwargs) -> "GlobalTensor":
        """torch's, ``dtype`` included (the tensor is cast first, as torch computes in it)."""
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
        """torch's ``flatten(start_dim=0, end_dim=-1)``; a view where torch's would be one."""
        return _reshaped(self, apply_op("flatten", self, *args, **kwargs))

    def unsqueeze(self, *args, **kwargs) -> "GlobalTensor":
        """torch's ``unsqueeze(dim)``: a view with a new axis of size 1."""
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
        """torch's ``transpose(dim0, dim1)``: a view; a split axis moves with its sbp."""
        out = apply_op("transpose", self, dim0, dim1)
        return _viewed(out, self, "permute", _swapped(len(self._shape), dim0, dim1))

    def permute(self, *dims) -> "GlobalTensor":
        """torch's ``permute(*dims)``: a view; split axes move with their sbps."""
        dims = _shape_args(dims)
        out = apply_op("permute", self, dims=dims)
        return _viewed(out, self, "permute", tuple(d % self.ndim for d in dims))

    def t(self) -> "GlobalTensor":
        """torch's ``t()`` of a tensor of at most 2 axes: ``transpose(0, 1)``."""
        return self.transpose(0, 1) if self.ndim > 1 else \
            _viewed(apply_op("reshape", self, shape=self._shape), self, "reshape", self._shape)

    @property
    def T(self) -> "GlobalTensor":
        """torch's ``T``: the axes in reverse order (a view)."""
        return self.permute(*reversed(range(self.ndim)))

    def expand(self, *shape) -> "GlobalTensor":
        """torch's ``expand(*shape)``: a view with axes of size 1 broadcast to ``shape`` (``-1``
        keeps an axis)."""
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
        """torch's ``split(split_size, dim)``: a tuple of views of ``split_size`` (an int or a list
        of sizes) along ``dim``."""
        if _RESPLITS and self._sbp:
            _watch_resplit(self, dim)
        return _pieces(self, apply_op("split", self, split_size=split_size, dim=dim), dim)

    def chunk(self, chunks: int, dim: int = 0):
        """torch's ``chunk(chunks, dim)``: ``chunks`` views along ``dim``, as torch sizes them."""
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
        """``to(torch.float32)``."""
        return self.to(torch.float32)

    def double(self, memory_format=None) -> "GlobalTensor":
        """``to(torch.float64)``."""
        return self.to(torch.float64)

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


# what every class body defines itself (not a method to copy)
_CLASS_NAMES = frozenset(vars(type("_Empty", (), {"__slots__": ()})))


def _set_methods(cls: type) -> None:
    """Give ``cls`` (GlobalTensor) the methods of `_OpMethods`, then every other public
    ``torch.Tensor`` method as a call of `__torch_function__` (`_bind_torch_methods`)."""
    for name, value in vars(_OpMethods).items():
        if name not in _CLASS_NAMES:
            setattr(cls, name, value)
    _bind_torch_methods(cls)
