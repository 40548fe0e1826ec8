"""Ops that work along some axes and leave the others alone (``pad``, ``cumsum``, ``cumprod``,
``logcumsumexp``, ``flip``, ``roll``, ``triu`` / ``tril`` (the last two axes), ``gather``,
``scatter``, ``scatter_add``, ``index_select`` by a tensor, ``repeat_interleave``),
and ``isin``, elementwise in its first input. Each runs torch's kernel on the local shards; an
axis the op works along is whole on every rank, every other axis keeps its split (one mesh dim;
all ``B`` is valid everywhere):

* pad: ``S(a)`` for an axis not padded; ``P -> P`` (constant 0). cumsum, cumprod: ``S(a)``,
  ``a != dim``; ``P -> P`` (cumsum). isin(elements, test): ``(S(a), B) -> S(a)``;
* gather(x, index): ``(S(a), S(a))``, ``a != dim``, index as long as x on ``a``; ``(B, S(dim))
  -> S(dim)``; ``(P, B) -> P``. scatter, scatter_add: all ``S(a)``, ``a != dim``, as long on
  ``a``; ``(P, B, P) -> P`` (scatter_add). index_select: ``(S(a), B)``, ``a != dim``; ``(B,
  S(0)) -> S(dim)``; ``(P, B) -> P``. repeat_interleave: ``S(a)`` on every axis (on ``dim``
  where the balanced parts line up); ``P -> P``. See docs/torch_models.md, 'What runs'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as TF

from .registry import Signature, TensorMeta, register, tensor_metas

__all__ = ["padded_axes"]


def _norm(dim: int, ndim: int) -> int:
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"dim {dim} is out of range for a tensor with {ndim} dimension(s)")
    return dim % n


def _kept(x: TensorMeta, whole, partial: bool) -> list[Signature]:
    """``S(a) -> S(a)`` for each axis not in ``whole`` (and longer than 1); ``P -> P`` when
    the op is linear; ``B -> B``."""
    sigs = [Signature([f"S({a})"], [f"S({a})"]) for a in range(x.ndim)
            if a not in whole and x.shape[a] > 1]
    if partial:
        sigs.append(Signature(["P"], ["P"]))
    return sigs + [Signature(["B"], ["B"])]


# -- pad ------------------------------------------------------------------------------------------
def padded_axes(ndim: int, pad) -> set:
    """The axes ``F.pad(x, pad)`` changes: pair ``i`` of ``pad`` is axis ``ndim - 1 - i``."""
    pairs = [(pad[2 * i], pad[2 * i + 1] if 2 * i + 1 < len(pad) else 0)
             for i in range((len(pad) + 1) // 2)]
    return {ndim - 1 - i for i, (lo, hi) in enumerate(pairs) if lo or hi}


def _pad(x, pad, mode="constant", value=None):
    return TF.pad(x, list(pad), mode, value)


def _pad_signatures(x: TensorMeta, pad, mode="constant", value=None) -> list[Signature]:
    linear = mode == "constant" and not value
    return _kept(x, padded_axes(x.ndim, pad), linear)


register("pad", _pad, _pad_signatures,
         doc="F.pad (any mode): the padded axes whole, the others keep their split")


# -- cumulative ops -------------------------------------------------------------------------------
def _cumulative(fn, linear: bool):
    def kernel(x, dim, dtype=None):
        return fn(x, dim, dtype=dtype)

    def signatures(x: TensorMeta, dim, dtype=None) -> list[Signature]:
        return _kept(x, {_norm(dim, x.ndim)} if x.ndim else set(), linear)
    return kernel, signatures


for _name, _fn, _linear in (("cumsum", torch.cumsum, True), ("cumprod", torch.cumprod, False)):
    register(_name, *_cumulative(_fn, _linear),
             doc=f"{_name} along dim (whole); the other axes keep their split")


# -- flips, rolls, triangles, log-cumsum-exp ---------------------------------------------------------
def _flip(x, dims):
    return torch.flip(x, dims)


def _flip_signatures(x: TensorMeta, dims) -> list[Signature]:
    return _kept(x, {_norm(d, x.ndim) for d in dims}, True)


def _roll(x, shifts, dims):
    return torch.roll(x, shifts, dims)


def _roll_signatures(x: TensorMeta, shifts, dims) -> list[Signature]:
    return _kept(x, {_norm(d, x.ndim) for d in dims}, True)


def _triangle(fn):
    def kernel(x, diagonal=0):
        return fn(x, diagonal)

    def signatures(x: TensorMeta, diagonal=0) -> list[Signature]:  # the last two axes whole
        return _kept(x, {x.ndim - 2, x.ndim - 1}, True)
    return kernel, signatures


def _logcumsumexp(x, dim):
    return torch.logcumsumexp(x, dim)


def _logcumsumexp_signatures(x: TensorMeta, dim) -> list[Signature]:
    return _kept(x, {_norm(dim, x.ndim)} if x.ndim else set(), False)


register("flip", _flip, _flip_signatures, doc="flip: the flipped axes whole, the others kept")
register("roll", _roll, _roll_signatures,
         doc="roll along dims: the rolled axes whole, the others keep their split")
register("triu", *_triangle(torch.triu), doc="triu: the last two axes whole, batch axes kept")
register("tril", *_triangle(torch.tril), doc="tril: the last two axes whole, batch axes kept")
register("logcumsumexp", _logcumsumexp, _logcumsumexp_signatures,
         doc="logcumsumexp along dim (whole); the other axes keep their split")


# -- gather / scatter -----------------------------------------------------------------------------
def _gather(x, index, dim):
    return torch.gather(x, dim, index)


def _gather_signatures(x: TensorMeta, index: TensorMeta, dim) -> list[Signature]:
    d = _norm(dim, x.ndim)
    sigs = [Signature([f"S({a})", f"S({a})"], [f"S({a})"]) for a in range(x.ndim)
            if a != d and x.shape[a] == index.shape[a] > 1]
    if index.shape[d] > 1:  # (an index split elsewhere would read x's first rows)
        sigs.append(Signature(["B", f"S({d})"], [f"S({d})"]))
    return sigs + [Signature(["P", "B"], ["P"]), Signature(["B", "B"], ["B"])]


def _scatter(x, index, src, dim, reduce=None):
    if reduce is None:
        return torch.scatter(x, dim, index, src)
    return torch.scatter(x, dim, index, src, reduce=reduce)


def _scatter_add(x, index, src, dim):
    return torch.scatter_add(x, dim, index, src)


def _scatter_signatures(linear: bool):
    def signatures(x: TensorMeta, index: TensorMeta, src, dim, reduce=None) -> list[Signature]:
        metas = tensor_metas((x, index, src))
        d = _norm(dim, x.ndim)
        sigs = [Signature([f"S({a})"] * len(metas), [f"S({a})"]) for a in range(x.ndim)
                if a != d and all(m.shape[a] == x.shape[a] for m in metas) and x.shape[a] > 1]
        if linear and len(metas) == 3:
            sigs.append(Signature(["P", "B", "P"], ["P"]))
        return sigs + [Signature(["B"] * len(metas), ["B"])]
    return signatures


register("gather", _gather, _gather_signatures,
         doc="torch.gather along dim (whole in x); the other axes keep their split")
register("scatter", _scatter, _scatter_signatures(False),
         doc="torch.scatter (src a tensor or a number) along dim (whole)")
register("scatter_add", _scatter_add, _scatter_signatures(True),
         doc="torch.scatter_add along dim (whole); partial input and src stay partial")


def _index_select(x, index, dim):
    return torch.index_select(x, dim, index)


def _index_select_signatures(x: TensorMeta, index: TensorMeta, dim) -> list[Signature]:
    d = _norm(dim, x.ndim)
    sigs = [Signature([f"S({a})", "B"], [f"S({a})"]) for a in range(x.ndim)
            if a != d and x.shape[a] > 1]
    if index.ndim and index.shape[0] > 1:  # the picks split: the output split on dim
        sigs.append(Signature(["B", "S(0)"], [f"S({d})"]))
    return sigs + [Signature(["P", "B"], ["P"]), Signature(["B", "B"], ["B"])]


register("index_select_tensor", _index_select, _index_select_signatures,
         doc="torch.index_select by a tensor of indices along dim (whole in x)")


# -- repeat_interleave, isin ----------------------------------------------------------------------
def _repeat_interleave(x, repeats, dim):
    return torch.repeat_interleave(x, repeats, dim)


def _repeat_signatures(x: TensorMeta, repeats, dim) -> list[Signature]:
    return _kept(x, set(), True)


register("repeat_interleave", _repeat_interleave, _repeat_signatures,
         doc="repeat_interleave by an int along dim; a split on dim kept where the parts line up")


def _isin(elements, test_elements, assume_unique=False, invert=False):
    return torch.isin(elements, test_elements, assume_unique=assume_unique, invert=invert)


def _isin_signatures(elements: TensorMeta, test: TensorMeta, **_) -> list[Signature]:
    sigs = [Signature([f"S({a})", "B"], [f"S({a})"]) for a in range(elements.ndim)
            if elements.shape[a] > 1]
    return sigs + [Signature(["B", "B"], ["B"])]


register("isin", _isin, _isin_signatures,
         doc="torch.isin: elementwise in elements (any split), test_elements whole (B)")
