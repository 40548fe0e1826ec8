"""The table of torch functions with an sbpflow version (`torch_functions.register`).

Each entry takes torch's arguments (names and defaults as torch's) and runs the sbpflow function
of the same meaning: ``F.linear`` is `sf.nn.functional.linear`, ``F.scaled_dot_product_attention``
the composite of `sbpflow.nn.functional`, ``Tensor.normal_`` the layout-independent fill of
`sbpflow.nn.init` (sbpflow's random stream, not torch's). Arguments torch has and sbpflow does not
implement (``F.embedding(max_norm=...)``, a deprecated ``size_average``) are refused by name.
Functions whose name matches a GlobalTensor method need no entry (`torch_functions.handler_for`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as TF

from ..sbp import B, Partial
from ..tensor import GlobalTensor, UnsupportedTorchFunction, apply_op, cat, full, is_view
from ..tensor import _next_seed, fresh
from ..tensor import rand as _rand, randn as _randn, tensor as _tensor
from . import functional as F
from . import functional_conv as FC
from . import init
from .torch_fallback import _write_out, fallback_for
from .torch_functions import register, torch_name, unsupported
from .torch_indexing import getitem

__all__ = ["install"]


def _refuse_arg(func_name: str, arg: str, value, fix: str) -> UnsupportedTorchFunction:
    return UnsupportedTorchFunction(f"{func_name}({arg}={value!r}) is not supported on sbpflow "
                                    f"global tensors; {fix}")


def _replicated_sbp(t: GlobalTensor) -> tuple:
    """``t``'s layout with partial mesh dims replicated (a fresh value is not a partial sum)."""
    return tuple(B if isinstance(s, Partial) else s for s in t.sbp)


def _full_like(t: GlobalTensor, value, dtype=None, requires_grad: bool = False) -> GlobalTensor:
    return full(tuple(t.shape), value, placement=t.placement, sbp=_replicated_sbp(t),
                dtype=dtype or t.dtype, requires_grad=requires_grad)


def _shape(size) -> tuple:
    return tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) \
        else tuple(size)


# -- torch.nn.functional --------------------------------------------------------------------------
def _linear(input, weight, bias=None):
    return F.linear(input, weight, bias)


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return F.layer_norm(input, normalized_shape, weight, bias, eps)


def _embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
               scale_grad_by_freq=False, sparse=False):
    for arg, value, default in (("max_norm", max_norm, None), ("sparse", sparse, False),
                                ("scale_grad_by_freq", scale_grad_by_freq, False)):
        if value != default:
            raise _refuse_arg("torch.nn.functional.embedding", arg, value,
                              "renormalise the table yourself, or drop the argument")
    return F.embedding(input, weight, padding_idx)


def _activation(fn):
    def run(input, inplace=False):
        out = fn(input)
        return input._assign_(out) if inplace else out
    return run


def _softmax_dim(ndim: int) -> int:
    return 0 if ndim in (0, 1, 3) else 1  # torch's implicit dim (deprecated)


def _softmax(input, dim=None, _stacklevel=3, dtype=None):
    return F.softmax(input, _softmax_dim(input.ndim) if dim is None else dim, dtype)


def _log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    return F.log_softmax(input, _softmax_dim(input.ndim) if dim is None else dim, dtype)


def _dropout(input, p=0.5, training=True, inplace=False):
    out = F.dropout(input, p, training)
    return input._assign_(out) if inplace and out is not input else out


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    if enable_gqa and key.ndim >= 3 and query.shape[-3] != key.shape[-3]:
        # torch's meaning: each key / value head serves query.shape[-3] // key.shape[-3] query
        # heads. Repeated in place (repeat_interleave keeps a split of the heads where the key
        # heads divide among the ranks), so the heads stay split as in plain attention
        groups = query.shape[-3] // key.shape[-3]
        key = _repeat_interleave(key, groups, dim=-3)
        value = _repeat_interleave(value, groups, dim=-3)
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                          scale)


def _legacy_reduction(name: str, size_average, reduce) -> None:
    if size_average is not None or reduce is not None:
        raise _refuse_arg(f"torch.nn.functional.{name}", "size_average / reduce",
                          (size_average, reduce), "give reduction='mean' / 'sum' / 'none'")


def _cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                   reduce=None, reduction="mean", label_smoothing=0.0):
    _legacy_reduction("cross_entropy", size_average, reduce)
    return F.cross_entropy(input, target, weight, ignore_index, reduction, label_smoothing)


def _mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    _legacy_reduction("mse_loss", size_average, reduce)
    if weight is not None:
        raise _refuse_arg("torch.nn.functional.mse_loss", "weight", "<tensor>",
                          "multiply the squared error by the weights yourself")
    d = input - target
    d = d * d
    return d if reduction == "none" else d.sum() if reduction == "sum" else d.mean()


def _max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                return_indices=False):
    return FC.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode,
                         return_indices)


def _norm_functions() -> dict:
    """``F.batch_norm`` / ``group_norm`` / ``rms_norm`` (sbpflow/nn/functional_norm.py)."""
    from . import functional_norm as FN

    def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                   momentum=0.1, eps=1e-5):
        # torch's functional form has no num_batches_tracked: momentum None is then refused
        return FN.batch_norm(input, running_mean, running_var, weight, bias, training,
                             momentum, eps)

    return {TF.batch_norm: batch_norm,
            TF.group_norm: lambda input, num_groups, weight=None, bias=None, eps=1e-5:
                FN.group_norm(input, num_groups, weight, bias, eps),
            TF.rms_norm: lambda input, normalized_shape, weight=None, eps=None:
                FN.rms_norm(input, normalized_shape, weight, eps)}


def _nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
              reduction="mean"):
    _legacy_reduction("nll_loss", size_average, reduce)
    return F.nll_loss(input, target, weight, ignore_index, reduction)


_FUNCTIONAL = {
    TF.leaky_relu: lambda input, negative_slope=0.01, inplace=False: _activation(
        lambda x: F.leaky_relu(x, negative_slope))(input, inplace),
    TF.elu: lambda input, alpha=1.0, inplace=False: _activation(
        lambda x: F.elu(x, alpha))(input, inplace),
    TF.softplus: lambda input, beta=1.0, threshold=20.0: F.softplus(input, beta, threshold),
    TF.normalize: lambda input, p=2.0, dim=1, eps=1e-12, out=None: F.normalize(input, p, dim,
                                                                               eps),
    TF.one_hot: lambda tensor, num_classes=-1: F.one_hot(tensor, num_classes),
    TF.nll_loss: _nll_loss,
    TF.linear: _linear, TF.layer_norm: _layer_norm, TF.embedding: _embedding,
    TF.relu: _activation(F.relu), TF.silu: _activation(F.silu),
    TF.gelu: lambda input, approximate="none": F.gelu(input, approximate),
    TF.tanh: F.tanh, TF.sigmoid: F.sigmoid,
    TF.softmax: _softmax, TF.log_softmax: _log_softmax, TF.dropout: _dropout,
    TF.scaled_dot_product_attention: _sdpa, TF.cross_entropy: _cross_entropy,
    TF.mse_loss: _mse_loss, TF.conv2d: FC.conv2d, TF.max_pool2d: _max_pool2d,
    TF.avg_pool2d: FC.avg_pool2d, TF.adaptive_avg_pool2d: FC.adaptive_avg_pool2d,
}


# -- torch.* --------------------------------------------------------------------------------------
def _legacy_empty(t) -> bool:
    return t.ndim == 1 and t.shape[0] == 0


def _cat(tensors, dim=0, *, out=None):
    """torch.cat, with torch's legacy rule: a 1-D tensor of 0 elements is skipped (its dtype
    still takes part in the result's), whatever the others' shapes."""
    if out is not None:
        raise _refuse_arg("torch.cat", "out", "<tensor>", "use the returned tensor")
    tensors = list(tensors)
    kept = [t for t in tensors if not _legacy_empty(t)]
    if kept and len(kept) < len(tensors):
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
        tensors = [t if t.dtype == dtype else t.to(dtype) for t in kept]
    return cat(tensors, dim)


def _stack(tensors, dim=0, *, out=None):
    if out is not None:
        raise _refuse_arg("torch.stack", "out", "<tensor>", "use the returned tensor")
    return cat([t.unsqueeze(dim) for t in tensors], dim)


def _where(condition, input=None, other=None, *, out=None):
    if input is None or other is None:
        return unsupported(torch.where, "the one-argument form (nonzero)")(condition)
    return apply_op("where", condition, input, other)


def _like(value):
    def make(input, dtype=None, layout=None, device=None, requires_grad=False,
             memory_format=None):
        return _full_like(input, value, dtype, requires_grad)
    return make


def _full_like_fn(input, fill_value, dtype=None, layout=None, device=None, requires_grad=False,
                  memory_format=None):
    return _full_like(input, fill_value, dtype, requires_grad)


def _random_like(make):
    def run(input, dtype=None, layout=None, device=None, requires_grad=False,
            memory_format=None):
        return make(*input.shape, placement=input.placement, sbp=_replicated_sbp(input),
                    dtype=dtype or input.dtype, requires_grad=requires_grad)
    return run


_TORCH = {
    torch.cat: _cat, torch.concat: _cat, torch.concatenate: _cat, torch.stack: _stack,
    torch.where: _where, torch.bmm: lambda input, mat2: input @ mat2,
    torch.zeros_like: _like(0), torch.ones_like: _like(1), torch.empty_like: _like(0),
    torch.full_like: _full_like_fn, torch.rand_like: _random_like(_rand),
    torch.randn_like: _random_like(_randn),
    torch.softmax: lambda input, dim, dtype=None: F.softmax(input, dim, dtype),
    torch.log_softmax: lambda input, dim, dtype=None: F.log_softmax(input, dim, dtype),
}


# -- Tensor methods and properties --------------------------------------------------------------------
def _new_full(self, size, fill_value, dtype=None, device=None, requires_grad=False, **_):
    return full(_shape((size,)) if isinstance(size, int) else tuple(size), fill_value,
                placement=self.placement, sbp=(B,) * self.placement.ndim,
                dtype=dtype or self.dtype, requires_grad=requires_grad)


def _new_value(value):
    def make(self, *size, dtype=None, device=None, requires_grad=False, **_):
        return _new_full(self, _shape(size), value, dtype, device, requires_grad)
    return make


def _copy_(self, src, non_blocking=False):
    if tuple(src.shape) != tuple(self.shape):
        src = src.expand(*self.shape)
    if torch.is_grad_enabled() and self.requires_grad and not self.is_leaf and \
            not getattr(src, "requires_grad", False):
        # as torch: the written tensor stays in the graph, its old value's gradient zero
        src = torch.where(torch.ones((), dtype=torch.bool), src, self)
    return self._assign_(src, fresh=False)  # src stays src's: copied if self takes a shard


def _count(mask: GlobalTensor, dim, keepdim: bool) -> GlobalTensor:
    return mask.to(torch.int64).sum(dim, keepdim) if dim is not None else \
        mask.to(torch.int64).sum()


def _unbind(self, dim=0):
    d = dim % max(self.ndim, 1)
    return tuple(self[(slice(None),) * d + (i,)] for i in range(self.shape[d]))


def _cast(dtype):
    return lambda self, memory_format=None: self.to(dtype)


def _device_move(kind: str):
    def move(self, *args, **kwargs):
        if self.placement.device_type == kind:
            return self
        raise UnsupportedTorchFunction(
            f"Tensor.{kind}() on a global tensor on {self.placement}: a placement names its "
            f"devices; move it with .to_global(placement=sf.placement({kind!r}, ranks))")
    return move


def _fill_(self: GlobalTensor, value) -> GlobalTensor:
    """``zero_`` / ``fill_``: a tensor in the autograd graph stays in it, as torch's (its
    earlier value gets a zero gradient: a ``where`` that picks ``value`` everywhere, with no
    NaN from ``0 * inf``); any other takes the constant."""
    if self.requires_grad and not self.is_leaf and torch.is_grad_enabled():
        return self._assign_(apply_op("where", _full_like(self, True, torch.bool),
                                      _full_like(self, value), self))
    return self._assign_(_full_like(self, value))


def _on_device(kind: str):
    """``x.cpu()`` / ``x.cuda()``: the tensor itself on a placement of that device type (torch
    returns the tensor when it is already there); another type is a ``to_global``."""
    def move(self, *args, **kwargs):
        if self.placement.device_type == kind:
            return self
        raise UnsupportedTorchFunction(
            f"Tensor.{kind}() on a global tensor of {self.placement}: move it to another "
            f"device type with x.to_global(placement=sf.placement('{kind}', ranks))")
    return move


_METHODS = {
    "cpu": _on_device("cpu"), "cuda": _on_device("cuda"),
    "masked_fill": lambda self, mask, value: apply_op("where", mask, value, self),
    "zero_": lambda self: _fill_(self, 0),
    "fill_": lambda self, value: _fill_(self, value),
    "copy_": _copy_,
    "normal_": lambda self, mean=0.0, std=1.0, *, generator=None:
        _filled(init.normal_)(self, mean, std, generator=generator),
    "uniform_": lambda self, a=0.0, b=1.0, *, generator=None:
        _filled(init.uniform_)(self, a, b, generator=generator),
    "type_as": lambda self, other: self.to(other.dtype),
    "view_as": lambda self, other: self.reshape(tuple(other.shape)),
    "reshape_as": lambda self, other: self.reshape(tuple(other.shape)),
    "expand_as": lambda self, other: self.expand(*other.shape),
    "new_zeros": _new_value(0), "new_ones": _new_value(1), "new_empty": _new_value(0),
    "new_full": _new_full,
    "new_tensor": lambda self, data, dtype=None, device=None, requires_grad=False: _tensor(
        data, self.placement, (B,) * self.placement.ndim, dtype=dtype,
        requires_grad=requires_grad),
    "any": lambda self, dim=None, keepdim=False: _count(self.ne(0), dim, keepdim) > 0,
    "all": lambda self, dim=None, keepdim=False: _count(self.eq(0), dim, keepdim) == 0,
    "unbind": _unbind, "tolist": lambda self: self.full_tensor().tolist(),
    "long": _cast(torch.int64), "int": _cast(torch.int32), "bool": _cast(torch.bool),
    "half": _cast(torch.float16), "bfloat16": _cast(torch.bfloat16),
    "short": _cast(torch.int16),
    "cpu": _device_move("cpu"), "cuda": _device_move("cuda"),
    "is_floating_point": lambda self: self.dtype.is_floating_point,
    "is_complex": lambda self: self.dtype.is_complex,
    "element_size": lambda self: self.local.element_size(),
    "ndimension": lambda self: self.ndim, "nelement": lambda self: self.numel(),
    "get_device": lambda self: self.local.get_device(),
    "is_contiguous": lambda self, memory_format=None: True,
}

_PROPERTIES = {
    "data": lambda self: self.detach(),
    "is_cuda": lambda self: self.placement.device_type == "cuda",
    "is_cpu": lambda self: self.placement.device_type == "cpu",
    "is_meta": lambda self: self.local.is_meta,
    "grad_fn": lambda self: self.local.grad_fn,
    "layout": lambda self: torch.strided,
    "itemsize": lambda self: self.local.element_size(),
    "nbytes": lambda self: self.numel() * self.local.element_size(),
    "mT": lambda self: self.transpose(-2, -1),
    "is_sparse": lambda self: False, "is_quantized": lambda self: False,
    "is_nested": lambda self: False,
}


# -- values and indices along an axis (sbpflow/ops/select.py), variance ---------------------------
def _no_out(name: str, out) -> None:
    if out is not None:
        raise _refuse_arg(f"torch.{name}", "out", "<tensor>", "use the returned tensors")


def _structured(kind: str, *values) -> tuple:
    """torch's named tuple ``torch.return_types.<kind>`` holding global tensors."""
    return getattr(torch.return_types, kind)(values)


def _max_min(which: str):
    """``max`` / ``min`` in every form torch has: of the whole tensor (a value), along a dim
    (values and indices), or against another tensor (elementwise)."""
    whole, elementwise = ("amax", "maximum") if which == "max" else ("amin", "minimum")

    def run(input, dim=None, keepdim=False, *, other=None, out=None):
        _no_out(which, out)
        if isinstance(dim, GlobalTensor):
            dim, other = None, dim
        if other is not None:
            return apply_op(elementwise, input, other)
        if dim is None:
            return apply_op(whole, input)
        return _structured(which, *apply_op(f"{which}_dim", input, dim=int(dim),
                                             keepdim=bool(keepdim)))
    return run


def _pick(kind: str, op: str, dim_default=-1):
    """``kthvalue`` / ``median`` / ``mode`` along a dim: torch's (values, indices)."""
    def run(input, dim=dim_default, keepdim=False, *, out=None):
        _no_out(kind, out)
        if dim is None:  # torch.median(x): the lower median of every entry, a value
            return apply_op(op, input.reshape(-1), dim=0, keepdim=False)[0]
        return _structured(kind, *apply_op(op, input, dim=int(dim), keepdim=bool(keepdim)))
    return run


def _kthvalue(input, k, dim=-1, keepdim=False, *, out=None):
    _no_out("kthvalue", out)
    return _structured("kthvalue", *apply_op("kthvalue", input, k=int(k), dim=int(dim),
                                               keepdim=bool(keepdim)))


def _sort(input, dim=-1, descending=False, stable=False, *, out=None):
    _no_out("sort", out)
    if isinstance(dim, bool):  # sort(stable=..., dim, descending) spelled positionally
        raise _refuse_arg("Tensor.sort", "dim", dim, "give dim as an int")
    return _structured("sort", *apply_op("sort", input, dim=int(dim), descending=bool(descending),
                                           stable=bool(stable)))


def _argsort(input, dim=-1, descending=False, stable=False):
    return _sort(input, dim, descending, stable).indices


def _topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    _no_out("topk", out)
    return _structured("topk", *apply_op("topk", input, k=int(k), dim=int(dim),
                                           largest=bool(largest), sorted=bool(sorted)))


def _arg(op: str):
    def run(input, dim=None, keepdim=False, *, out=None):
        _no_out(op, out)
        return apply_op(op, input, dim=None if dim is None else int(dim), keepdim=bool(keepdim))
    return run


def _aminmax(input, *, dim=None, keepdim=False, out=None):
    _no_out("aminmax", out)
    if dim is None and not keepdim:
        return _structured("aminmax", input.amin(), input.amax())
    return _structured("aminmax", input.amin(dim, keepdim), input.amax(dim, keepdim))


def _variance(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """torch.var in its three spellings: ``var(x, unbiased)``, ``var(x, dim, unbiased,
    keepdim)``, ``var(x, dim, correction=, keepdim=)``: two passes (mean, then the mean
    squared deviation), so a split reduced axis gives partial sums, as ``mean`` does."""
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    if correction is None:
        correction = 0 if unbiased is False else 1
    dims = range(input.ndim) if dim is None or dim == () else \
        [d % max(input.ndim, 1) for d in ((dim,) if isinstance(dim, int) else dim)]
    count = 1
    for d in set(dims):
        count *= input.shape[d] if input.ndim else 1
    dev = input - input.mean(dim=dim, keepdim=True)
    return (dev * dev).sum(dim=dim, keepdim=keepdim) / max(count - correction, 0)


def _std(*args, **kwargs):
    return _variance(*args, **kwargs).sqrt()


def _with_mean(spread):
    """``var_mean`` / ``std_mean``: (spread, mean), a plain tuple as torch's."""
    def run(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        mean_dim = None if isinstance(dim, bool) else dim
        return (spread(input, dim, unbiased, keepdim, correction=correction),
                input.mean(dim=mean_dim, keepdim=keepdim))
    return run


_SELECT_METHODS = {
    "max": _max_min("max"), "min": _max_min("min"), "sort": _sort, "topk": _topk,
    "argsort": _argsort, "kthvalue": _kthvalue, "median": _pick("median", "median_dim", None),
    "mode": _pick("mode", "mode"), "argmax": _arg("argmax"), "argmin": _arg("argmin"),
    "aminmax": _aminmax, "var": _variance, "std": _std,
}
_SELECT_TORCH = {torch.var_mean: _with_mean(_variance), torch.std_mean: _with_mean(_std)}


# -- hot ops of real models: their own rules, nothing gathered (sbpflow/ops/along.py) ---------
def _fallback(func):
    """The handler of ``func`` without a rule (torch_fallback): for the forms a rule here does
    not cover."""
    return fallback_for(func, torch_name(func))


def _with_out(name: str, fn):
    """``fn`` taking torch's ``out=`` too: the result is written into ``out`` (torch's
    semantics, as the fallback does)."""
    def run(*args, out=None, **kwargs):
        result = fn(*args, **kwargs)
        return result if out is None else _write_out(out, result, name)
    return run


def _scaled_sum(input, product, beta, alpha):
    """``beta * input + alpha * product`` as torch's addmm family computes it (``beta == 0``
    ignores ``input``, nan and inf included)."""
    if alpha != 1:
        product = product * alpha
    if beta == 0:  # the output has the product's shape (input broadcasts to it)
        return product
    return (input if beta == 1 else input * beta) + product


def _addmm(input, mat1, mat2, *, beta=1, alpha=1):
    """addmm / baddbmm / addmv (torch's argument names: BLOOM's attention calls
    ``torch.baddbmm(alibi, batch1=q, batch2=k, beta=, alpha=)``): the matmul op, then add (its
    signatures: a weight split by columns keeps the output split, a split reduced dim gives a
    partial product, ...)."""
    return _scaled_sum(input, mat1 @ mat2, beta, alpha)


def _baddbmm(input, batch1, batch2, *, beta=1, alpha=1):
    return _scaled_sum(input, batch1 @ batch2, beta, alpha)


def _addmv(input, mat, vec, *, beta=1, alpha=1):
    return _scaled_sum(input, mat @ vec, beta, alpha)


def _pad(input, pad, mode="constant", value=None):
    return apply_op("pad", input, pad=tuple(int(p) for p in pad), mode=mode,
                    value=None if value is None else float(value))


def _cumulative(op: str):
    def run(input, dim, *, dtype=None):
        return apply_op(op, input, dim=int(dim), dtype=dtype)
    return run


def _dims(dims: tuple) -> tuple:
    """``x.flip(0, 1)`` or ``torch.flip(x, (0, 1))``: the dims as one tuple of ints."""
    if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)):
        dims = tuple(dims[0])
    return tuple(int(d) for d in dims)


def _flip(input, *dims, **kw):
    return apply_op("flip", input, dims=_dims(tuple(dims) or (kw.pop("dims"),)))


def _roll(input, shifts, dims=None):
    if dims is None:  # rolled as if flattened
        return _fallback(torch.roll)(input, shifts)
    shifts, dims = _dims((shifts,)), _dims((dims,))
    if len(shifts) != len(dims):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, "
                           f"dims:{len(dims)}")   # torch's message
    return apply_op("roll", input, shifts=shifts, dims=dims)


def _triangle(op: str):
    def run(input, diagonal=0):
        return apply_op(op, input, diagonal=int(diagonal))
    return run


def _logcumsumexp(input, dim):
    return apply_op("logcumsumexp", input, dim=int(dim))


def _cumulative_pick(kind: str):
    def run(input, dim):
        return _structured(kind, *apply_op(kind, input, dim=int(dim)))
    return run


def _isin(elements, test_elements, *, assume_unique=False, invert=False):
    if not isinstance(elements, GlobalTensor):
        return _fallback(torch.isin)(elements, test_elements, assume_unique=assume_unique,
                                     invert=invert)
    if not isinstance(test_elements, GlobalTensor):  # a number
        return elements != test_elements if invert else elements == test_elements
    return apply_op("isin", elements, test_elements, assume_unique=bool(assume_unique),
                    invert=bool(invert))


def _gather(input, dim, index, *, sparse_grad=False):
    return apply_op("gather", input, index, dim=int(dim))


def _scatter(input, dim, index, src=None, value=None, *, reduce=None):
    src = value if src is None else src
    return apply_op("scatter", input, index, src, dim=int(dim), reduce=reduce)


def _scatter_add(input, dim, index, src):
    return apply_op("scatter_add", input, index, src, dim=int(dim))


def _index_select(input, dim, index):
    return apply_op("index_select_tensor", input, index, dim=int(dim))


def _multinomial(input, num_samples, replacement=False, *, generator=None):
    """Row by row from sbpflow's stream (`sbpflow.ops.sampling`: the same in every layout, no
    row gathered); with a torch ``generator``, its draw on the whole value (the fallback)."""
    if generator is not None or not isinstance(input, GlobalTensor):
        return _fallback(torch.multinomial)(input, num_samples, replacement, generator=generator)
    pl = input.placement

    def seed():  # a graph draws a new seed on every replay
        return full((), _next_seed(None, None), placement=pl, sbp=(B,) * pl.ndim,
                    dtype=torch.int64)
    return apply_op("multinomial", input, fresh(seed), num_samples=int(num_samples),
                    replacement=bool(replacement))


def _repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    if isinstance(repeats, (GlobalTensor, torch.Tensor)) or repeats is None:
        return _fallback(torch.repeat_interleave)(input, repeats, dim, output_size=output_size)
    if dim is None:
        input, dim = input.reshape(-1), 0
    return apply_op("repeat_interleave", input, int(repeats), dim=int(dim))


def _parse_einsum(equation: str, operands: tuple):
    """(letters of a, of b, of the output) for the einsum forms with a rule: two operands, no
    ellipsis, no letter twice in one operand, matching sizes; else None."""
    eq = equation.replace(" ", "")
    if len(operands) != 2 or "." in eq or not all(isinstance(o, GlobalTensor) for o in operands):
        return None
    lhs, arrow, out = eq.partition("->")
    ins = lhs.split(",")
    if len(ins) != 2:
        return None
    la, lb = ins
    if not arrow:  # implicit output: the letters seen once, in alphabetical order
        out = "".join(sorted(c for c in set(la + lb) if (la + lb).count(c) == 1))
    a, b = operands
    if len(la) != a.ndim or len(lb) != b.ndim or len(set(la)) < len(la) or \
            len(set(lb)) < len(lb) or len(set(out)) < len(out) or \
            not set(out) <= set(la) | set(lb):
        return None
    if any(a.shape[la.index(c)] != b.shape[lb.index(c)] for c in set(la) & set(lb)):
        return None  # size-1 broadcasting: the fallback
    return la, lb, out


def _einsum(equation, *operands):
    """einsum of two operands as existing ops: summed-out letters first, then a broadcast
    product (no contraction) or a batched matmul (batch letters, a's free letters, the
    contracted ones, b's free letters), reshaped and permuted to the output."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    parsed = _parse_einsum(equation, operands) if isinstance(equation, str) else None
    if parsed is None:
        return _fallback(torch.einsum)(equation, *operands)
    la, lb, out = parsed
    a, b = operands

    def drop(t, letters, other):  # sum the letters neither the output nor the other has
        gone = [i for i, c in enumerate(letters) if c not in out and c not in other]
        if gone:
            t = t.sum(dim=tuple(gone))
            letters = "".join(c for i, c in enumerate(letters) if i not in gone)
        return t, letters

    a, la = drop(a, la, lb)
    b, lb = drop(b, lb, la)
    size = {c: a.shape[i] for i, c in enumerate(la)} | {c: b.shape[i] for i, c in enumerate(lb)}

    def arrange(t, letters, order):
        perm = [letters.index(c) for c in order]
        return t.permute(*perm) if perm != list(range(len(perm))) else t

    contracted = [c for c in la if c in lb and c not in out]
    if not contracted:  # a broadcast product, each operand aligned to the output's letters
        def align(t, letters):
            t = arrange(t, letters, [c for c in out if c in letters])
            shape = [size[c] if c in letters else 1 for c in out]
            return t.reshape(*shape) if tuple(shape) != tuple(t.shape) else t
        return align(a, la) * align(b, lb)
    batch = [c for c in out if c in la and c in lb]
    fa = [c for c in la if c not in lb]
    fb = [c for c in lb if c not in la]

    def prod(letters):
        n = 1
        for c in letters:
            n *= size[c]
        return n

    bs = [size[c] for c in batch]
    a = arrange(a, la, batch + fa + contracted)
    b = arrange(b, lb, batch + contracted + fb)
    sa, sb = (*bs, prod(fa), prod(contracted)), (*bs, prod(contracted), prod(fb))
    a = a.reshape(*sa) if tuple(a.shape) != sa else a
    b = b.reshape(*sb) if tuple(b.shape) != sb else b
    r = a @ b
    full = (*bs, *(size[c] for c in fa), *(size[c] for c in fb))
    r = r.reshape(*full) if tuple(r.shape) != full else r
    return arrange(r, "".join(batch + fa + fb), list(out))


_HOT_TORCH = {
    TF.pad: _pad,
    torch.einsum: _einsum,
    torch.isin: _with_out("torch.isin", _isin),
    torch.addmm: _with_out("torch.addmm", _addmm),
    torch.baddbmm: _with_out("torch.baddbmm", _baddbmm),
    torch.addmv: _with_out("torch.addmv", _addmv),
}
_HOT_METHODS = {
    "addmm": _addmm, "baddbmm": _baddbmm, "addmv": _addmv,
    "cumsum": _with_out("torch.cumsum", _cumulative("cumsum")),
    "cumprod": _with_out("torch.cumprod", _cumulative("cumprod")),
    "gather": _with_out("torch.gather", _gather),
    "scatter": _with_out("torch.scatter", _scatter),
    "scatter_add": _with_out("torch.scatter_add", _scatter_add),
    "index_select": _with_out("torch.index_select", _index_select),
    "repeat_interleave": _repeat_interleave,
    "multinomial": _with_out("torch.multinomial", _multinomial),
    "flip": _with_out("torch.flip", _flip), "roll": _roll,
    "triu": _with_out("torch.triu", _triangle("triu")),
    "tril": _with_out("torch.tril", _triangle("tril")),
    "logcumsumexp": _with_out("torch.logcumsumexp", _logcumsumexp),
    "cummax": _with_out("torch.cummax", _cumulative_pick("cummax")),
    "cummin": _with_out("torch.cummin", _cumulative_pick("cummin")),
}


# -- torch.nn.init (those that check for __torch_function__; the others call Tensor methods) ------
def _filled(fill):
    """``fill(tensor, ...)`` of `sbpflow.nn.init`, which writes the tensor's own shard; a view
    is filled through a new tensor it then takes (an in-place op), so the values reach the
    tensor it views, as torch's fills do."""
    def run(tensor, *args, **kwargs):
        if not is_view(tensor):
            return fill(tensor, *args, **kwargs)
        return tensor._assign_(fill(_full_like(tensor, 0), *args, **kwargs))
    return run


_INIT = {
    torch.nn.init.uniform_: lambda tensor, a=0.0, b=1.0, generator=None:
        _filled(init.uniform_)(tensor, a, b, generator=generator),
    torch.nn.init.normal_: lambda tensor, mean=0.0, std=1.0, generator=None:
        _filled(init.normal_)(tensor, mean, std, generator=generator),
    torch.nn.init.constant_: lambda tensor, val: _filled(init.constant_)(tensor, val),
    torch.nn.init.kaiming_uniform_: lambda tensor, a=0, mode="fan_in",
        nonlinearity="leaky_relu", generator=None: _filled(init.kaiming_uniform_)(
            tensor, a, mode, nonlinearity, generator=generator),
}


def install() -> None:
    """Register every entry of the tables (done on import of ``sbpflow.nn``)."""
    for table in (_FUNCTIONAL, _norm_functions(), _TORCH, _INIT, _SELECT_TORCH, _HOT_TORCH):
        for func, handler in table.items():
            register(func, handler)
    for name, handler in _METHODS.items():
        register(getattr(torch.Tensor, name), handler)
    for name, handler in _PROPERTIES.items():
        register(getattr(torch.Tensor, name), handler)
    for name, handler in {**_SELECT_METHODS, **_HOT_METHODS}.items():
        register(getattr(torch.Tensor, name), handler)
        if hasattr(torch, name):
            register(getattr(torch, name), handler)
    for name in ("numpy",):
        register(getattr(torch.Tensor, name), unsupported(getattr(torch.Tensor, name)))
    register(torch.Tensor.__getitem__, getitem)


install()
