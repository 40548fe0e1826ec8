"""Transformer ops: softmax / log_softmax, layer_norm, embedding, dropout, the causal mask, fused
attention, and the class pick and row log-sum-exp of cross-entropy.

See docs/internals.md, 'Transformer-op signatures'.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import IndexOutOfRange
from ..random_regions import generate_region
from ..sbp import Split, format_nd_sbp
from .registry import Signature, TensorMeta, register

__all__ = ["softmax_signatures", "layer_norm_signatures", "embedding_signatures",
           "dropout_signatures", "causal_mask_signatures", "attention_signatures",
           "row_cross_entropy_signatures", "cross_entropy_sum_signatures",
           "pick_class_signatures", "class_logsumexp_signatures", "count_dtype", "check_index_range",
           "id_out_of_range", "target_out_of_range"]


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# -- index range checks ----------------------------------------------------------------------------
# An id / target outside its range raises `IndexOutOfRange` (an SbpError and torch's IndexError)
# in every layout, checked once per call where it costs a local pass and no collective: torch's
# own kernel where the table / classes are whole (its error converted), `check_index_range` on a
# vocab / class split (the ids / target are B there, whole: every rank of that mesh dim reaches
# the same verdict, so the ranks of the partial sum's reduction raise together). Replicated ids /
# targets the signature choice may slice are checked whole before the op by
# `sf.nn.functional.embedding` / `cross_entropy` (the kernel is then told ``checked=True``).
# Split ids (S ids, replicated table: data parallelism) are checked by the ranks holding them, as
# in DDP; the launcher stops the others (threads: at once; processes: their next collective).

def check_index_range(index: torch.Tensor, size: int, ignore: int | None,
                      error: Callable[[], Exception | None]) -> None:
    """Raise ``error()`` unless every element of ``index`` lies in ``[0, size)`` or equals
    ``ignore`` (None: nothing is exempt). On CPU one fused min/max pass and a host read (an
    exact second pass only when some element lies outside: ignored or bad); on an accelerator
    a device-side assertion, as torch's own kernels, so the step does not wait for the host."""
    if not index.is_cpu:
        if not index.is_meta and index.numel():
            _assert_in_range(index, size, ignore)
        return
    if index.numel() == 0:
        return
    lo, hi = torch.aminmax(index)
    if lo.item() >= 0 and hi.item() < size:
        return
    err = error()  # None when every element outside is the ignored one
    if err is not None:
        raise err


def _assert_in_range(index: torch.Tensor, size: int, ignore: int | None) -> None:
    """The device-side form of `check_index_range`: the device stops at its next sync."""
    ok = (index >= 0) & (index < size)
    if ignore is not None:
        ok |= index == ignore
    torch._assert_async(ok.all(), f"index out of range [0, {size})")


def _first_outside(index: torch.Tensor, size: int, ignore: int | None) -> int | None:
    """The first element of ``index`` (row-major) outside ``[0, size)`` and not ``ignore``."""
    bad = (index < 0) | (index >= size)
    if ignore is not None:
        bad &= index != ignore
    found = index[bad]
    return int(found.reshape(-1)[0]) if found.numel() else None


def _describe_inputs(ctx, names: tuple) -> str:
    """The kernel's inputs as laid out where it ran (for error messages)."""
    parts = [f"{n} of shape {tuple(shape)} with sbp {format_nd_sbp(nd)}"
             for n, shape, nd in zip(names, ctx.in_shapes, ctx.ins)]
    return f"{', '.join(parts)} on {ctx.placement}"


# -- softmax / log_softmax -------------------------------------------------------------------------
def softmax_signatures(x: TensorMeta, dim: int = -1, dtype=None) -> list[Signature]:
    d = _norm_dim(dim, x.ndim) if x.ndim else 0
    sigs = [Signature([f"S({a})"], [f"S({a})"]) for a in range(x.ndim) if a != d]
    sigs.append(Signature(["B"], ["B"]))
    return sigs


register("softmax", lambda x, dim=-1, dtype=None: torch.softmax(x, dim, dtype=dtype),
         softmax_signatures, doc="softmax along dim (dim whole on each rank)")
register("log_softmax", lambda x, dim=-1, dtype=None: torch.log_softmax(x, dim, dtype=dtype),
         softmax_signatures, doc="log_softmax along dim (dim whole on each rank)")


# -- layer_norm ------------------------------------------------------------------------------------
def layer_norm_signatures(x: TensorMeta, normalized_shape=(), weight=None, bias=None,
                          eps: float = 1e-5) -> list[Signature]:
    lead = x.ndim - len(tuple(normalized_shape))
    params = [p for p in (weight, bias) if isinstance(p, TensorMeta)]
    sigs = [Signature([f"S({a})"] + ["B"] * len(params), [f"S({a})"]) for a in range(lead)]
    if isinstance(weight, TensorMeta):
        sigs.append(Signature(["B"] + ["P"] * len(params), ["P"]))
    sigs.append(Signature(["B"] * (1 + len(params)), ["B"]))
    return sigs


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return F.layer_norm(x, tuple(normalized_shape), weight, bias, eps)


register("layer_norm", _layer_norm, layer_norm_signatures,
         doc="layer_norm over the trailing normalized_shape (those axes whole on each rank)")


# -- embedding -------------------------------------------------------------------------------------
def embedding_signatures(ids: TensorMeta, weight: TensorMeta, padding_idx=None,
                         checked: bool = False) -> list[Signature]:
    sigs = [Signature([f"S({i})", "B"], [f"S({i})"]) for i in range(ids.ndim)]
    sigs += [Signature(["B", "S(1)"], [f"S({ids.ndim})"]),
             Signature(["B", "S(0)"], ["P"]),
             Signature(["B", "P"], ["P"]),
             Signature(["B", "B"], ["B"])]
    return sigs


def _embedding(ids, weight, padding_idx=None, checked=False, *, ctx=None):
    """``padding_idx`` is a non-negative row of the logical table (or None). An id outside
    ``[0, vocab)`` raises `IndexOutOfRange` (torch: negative ids too) on every rank that holds
    it: with the vocab split, every rank holding the ids (they are ``B`` there) checks them
    whole, so ranks that reduce the partial result together raise together. ``checked``: the
    caller has checked every rank's ids already (`sf.nn.functional.embedding`)."""
    if ctx is None or not any(s == Split(0) for s in ctx.ins[1]):
        # (ctx=None also runs on the local meta shapes of a vocab split: rows may be fewer)
        pad = padding_idx if padding_idx is not None and padding_idx < weight.shape[0] else None
        try:
            return F.embedding(ids, weight, pad)   # the whole vocab: torch's kernel checks ids
        except (IndexError, RuntimeError):  # torch's fbgemm lookup raises a RuntimeError
            error = None if ctx is None else _embedding_error(ids, ctx)
            if error is None:
                raise
            raise error from None
    # Vocab split (Megatron's VocabParallelEmbedding): look up only the rank's rows.
    start, size = ctx.in_boxes[1][0]
    if not checked:
        check_index_range(ids, ctx.in_shapes[1][0], None, lambda: _embedding_error(ids, ctx))
    if size == 0:  # more ranks than rows: nothing here, but stay on the weight's graph
        return weight.new_zeros(tuple(ids.shape) + (weight.shape[1],)) + weight.sum()
    inside = (ids >= start) & (ids < start + size)
    local_ids = torch.where(inside, ids - start, torch.zeros_like(ids))
    pad = padding_idx - start if padding_idx is not None and start <= padding_idx < start + size \
        else None
    return F.embedding(local_ids, weight, pad) * inside.unsqueeze(-1).to(weight.dtype)


def _embedding_error(ids, ctx) -> IndexOutOfRange | None:
    return id_out_of_range(ids, ctx.in_shapes[1][0], _describe_inputs(ctx, ("ids", "weight")))


def id_out_of_range(ids: torch.Tensor, vocab: int, layouts: str) -> IndexOutOfRange | None:
    """The error naming the first of ``ids`` outside ``[0, vocab)`` (None if there is none);
    ``layouts`` describes the inputs."""
    bad = _first_outside(ids, vocab, None)
    if bad is None:
        return None
    return IndexOutOfRange(
        f"embedding: id {bad} is out of range for a table of {vocab} rows (ids must lie in "
        f"[0, {vocab}), as torch's 'index out of range in self'; padding_idx is a row, not a "
        f"skipped id); {layouts}")


register("embedding", _embedding, embedding_signatures, context=True,
         doc="rows of weight (vocab, dim) at integer ids; vocab split gives a partial sum")


# -- dropout ---------------------------------------------------------------------------------------
def dropout_signatures(x: TensorMeta, seed: TensorMeta, p: float = 0.5) -> list[Signature]:
    sigs = [Signature([f"S({a})", "B"], [f"S({a})"]) for a in range(x.ndim)]
    sigs += [Signature(["P", "B"], ["P"]), Signature(["B", "B"], ["B"])]
    return sigs


def _is_fake(x: torch.Tensor) -> bool:
    """Whether ``x`` is a torch fake tensor (``FakeTensorMode``: a shape without storage)."""
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(x)


def dropout_mask(shape, box, seed: int, p: float, dtype: torch.dtype,
                 device=None) -> torch.Tensor:
    """The scaled keep-mask (``0`` or ``1 / (1 - p)``) of region ``box`` of a tensor of logical
    ``shape``: uniform draws of ``generate_region`` (float32), kept where ``u >= p``."""
    u = generate_region("rand", tuple(shape), tuple(box), int(seed), torch.float32)
    noise = (u >= p).to(dtype=dtype, device=device)
    return noise.div_(1 - p)  # as torch: x * (bernoulli(1 - p) / (1 - p))


def _dropout(x, seed, p=0.5, *, ctx=None):
    if x.device.type == "meta" or _is_fake(x):   # shapes only (sf.auto.trace): no draws
        return torch.empty_like(x)
    if ctx is None:  # one device: the whole tensor
        shape, box = tuple(x.shape), tuple((0, n) for n in x.shape)
    else:
        shape, box = ctx.in_shapes[0], ctx.in_boxes[0]
    return x * dropout_mask(shape, box, int(seed), p, x.dtype, x.device)


register("dropout", _dropout, dropout_signatures, context=True,
         doc="x * mask / (1 - p); the mask is the rank's region of one logical random tensor")


# -- causal mask -----------------------------------------------------------------------------------
def causal_mask_signatures(x: TensorMeta, value: float = float("-inf"),
                           diagonal: int = 0) -> list[Signature]:
    sigs = [Signature([f"S({a})"], [f"S({a})"]) for a in range(x.ndim)]
    sigs.append(Signature(["B"], ["B"]))
    return sigs


def _masked_fill_causal(x, value=float("-inf"), diagonal=0, *, ctx=None):
    """``x[..., i, j] = value`` where ``j > i + diagonal`` (global row i, column j)."""
    r0 = c0 = 0
    if ctx is not None:
        r0, c0 = ctx.in_boxes[0][-2][0], ctx.in_boxes[0][-1][0]
    rows = torch.arange(r0, r0 + x.shape[-2], device=x.device).unsqueeze(-1)
    cols = torch.arange(c0, c0 + x.shape[-1], device=x.device)
    return x.masked_fill(cols > rows + diagonal, value)


register("masked_fill_causal", _masked_fill_causal, causal_mask_signatures, context=True,
         doc="fill the entries above the diagonal of the last two axes (causal attention)")


# -- fused attention -------------------------------------------------------------------------------
def _same_split(n_inputs: int, axes: int) -> list[Signature]:
    """Every input and the output split on one axis ``a < axes``; then all ``B``."""
    sigs = [Signature([f"S({a})"] * n_inputs, [f"S({a})"]) for a in range(axes)]
    sigs.append(Signature(["B"] * n_inputs, ["B"]))
    return sigs


def attention_signatures(q: TensorMeta, k: TensorMeta, v: TensorMeta, is_causal: bool = False,
                         scale: float | None = None) -> list[Signature]:
    # batch / head axes only: every query row sees all keys of its own batch / head
    return _same_split(3, q.ndim - 2)


def _attention(q, k, v, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


register("attention", _attention, attention_signatures,
         doc="torch's fused scaled_dot_product_attention on local (batch / head) shards")


# -- cross-entropy per row, classes whole on each rank -----------------------------------------------
def row_cross_entropy_signatures(logits: TensorMeta, target: TensorMeta,
                                 ignore_index: int = -100) -> list[Signature]:
    return _same_split(2, logits.ndim - 1)


def _row_cross_entropy(logits, target, ignore_index=-100):
    """``-log_softmax(logits)[..., target]`` per row (0 where target == ignore_index)."""
    c = logits.shape[-1]
    out = F.cross_entropy(logits.reshape(-1, c), target.reshape(-1), ignore_index=ignore_index,
                          reduction="none")
    return out.view(target.shape)


register("row_cross_entropy", _row_cross_entropy, row_cross_entropy_signatures,
         doc="torch's fused cross-entropy of each row (classes on the last axis, not split)")


def cross_entropy_sum_signatures(logits: TensorMeta, target: TensorMeta,
                                 ignore_index: int = -100) -> list[Signature]:
    # summing rows split on an axis leaves partial sums; replicated rows give replicated sums
    sigs = [Signature([f"S({a})"] * 2, ["P", "P"]) for a in range(logits.ndim - 1)]
    sigs.append(Signature(["B", "B"], ["B", "B"]))
    return sigs


def count_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a count (of valid targets) is summed in, for values of ``dtype``: ``dtype``,
    or float32 when that is a 16-bit float (which rounds counts above 256)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _cross_entropy_sum(logits, target, ignore_index=-100):
    """(Σ rows' ``-log_softmax(logits)[target]``, number of rows whose target is not
    ``ignore_index``): the two 0-d parts of a mean cross-entropy. The count carries no
    gradient; it is in `count_dtype` of the sum's dtype (under autocast the sum of bf16 logits
    is float32)."""
    c = logits.shape[-1]
    total = F.cross_entropy(logits.reshape(-1, c), target.reshape(-1), ignore_index=ignore_index,
                            reduction="sum")
    count = (target != ignore_index).sum().to(count_dtype(total.dtype))
    return total, count


register("cross_entropy_sum", _cross_entropy_sum, cross_entropy_sum_signatures,
         doc="summed cross-entropy of the rows and their count of valid targets (classes on "
             "the last axis, not split): one kernel for the common mean / sum loss")


def cross_entropy_mean_signatures(logits: TensorMeta, target: TensorMeta,
                                  ignore_index: int = -100) -> list[Signature]:
    # replicated rows only: split rows leave partial sums whose count is summed over ranks
    # (`cross_entropy_sum`, then the mean)
    return [Signature(["B", "B"], ["B"])]


def _cross_entropy_mean(logits, target, ignore_index=-100):
    """torch's mean cross-entropy of the rows (classes on the last axis): the summed row
    losses over the number of targets not equal to ``ignore_index``, in one kernel (on CPU
    the same bits, value and gradient, as `_cross_entropy_sum`'s quotient)."""
    c = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, c), target.reshape(-1), ignore_index=ignore_index)


register("cross_entropy_mean", _cross_entropy_mean, cross_entropy_mean_signatures,
         doc="torch's mean cross-entropy of replicated rows (classes on the last axis): one "
             "kernel where every rank holds every row")


# -- the target class of cross-entropy -------------------------------------------------------------
def pick_class_signatures(logits: TensorMeta, target: TensorMeta, ignore_index: int = -100,
                          checked: bool = False) -> list[Signature]:
    last = logits.ndim - 1
    sigs = _same_split(2, last)
    sigs[-1:-1] = [Signature([f"S({last})", "B"], ["P"]), Signature(["P", "B"], ["P"])]
    return sigs


def _pick_class(logits, target, ignore_index=-100, checked=False, *, ctx=None):
    """``logits[..., target]`` (0 where target == ignore_index). With the class axis split, each
    rank contributes only the targets in its class range (the others are 0): a partial sum.
    A target outside ``[0, C)`` other than ``ignore_index`` raises `IndexOutOfRange` (torch's
    "Target X is out of bounds") on every rank holding it: with the classes split the target
    is ``B`` there, so every rank of the partial sum checks it whole and they raise together.
    ``checked``: the caller has checked every rank's targets already."""
    if ctx is None:
        start, size, classes = 0, logits.shape[-1], logits.shape[-1]
    else:
        (start, size), classes = ctx.in_boxes[0][-1], ctx.in_shapes[0][-1]
        if not checked:
            check_index_range(target, classes, ignore_index,
                              lambda: _target_error(target, classes, ignore_index, ctx))
    if size == 0:
        return logits.new_zeros(target.shape) + logits.sum()
    inside = (target >= start) & (target < start + size) & (target != ignore_index)
    local = torch.where(inside, target - start, torch.zeros_like(target))
    picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    return picked * inside.to(logits.dtype)


def _target_error(target, classes: int, ignore_index: int, ctx) -> IndexOutOfRange | None:
    return target_out_of_range(target, classes, ignore_index,
                               _describe_inputs(ctx, ("logits", "target")))


def target_out_of_range(target: torch.Tensor, classes: int, ignore_index: int,
                        layouts: str) -> IndexOutOfRange | None:
    """The error naming the first of ``target`` outside ``[0, classes)`` and not
    ``ignore_index`` (None if there is none); ``layouts`` describes the inputs."""
    bad = _first_outside(target, classes, ignore_index)
    if bad is None:
        return None
    return IndexOutOfRange(
        f"cross_entropy: Target {bad} is out of bounds: {classes} classes (targets must lie in "
        f"[0, {classes}) or equal ignore_index {ignore_index}); {layouts}")


register("pick_class", _pick_class, pick_class_signatures, context=True,
         doc="logits (..., C) at integer target (...); class split gives a partial sum")


# -- the log-sum-exp of cross-entropy rows, classes split --------------------------------------------
def class_logsumexp_signatures(z: TensorMeta, s: TensorMeta) -> list[Signature]:
    last = z.ndim - 1
    sigs = _same_split(2, last)
    sigs.insert(-1, Signature([f"S({last})", "B"], ["P"]))
    return sigs


def _class_logsumexp(z, s, *, ctx=None):
    """``log(s)`` per row, where ``s`` is ``Σ_c exp(z)`` over ALL classes (all-reduced by the
    caller, carrying no gradient), with the gradient of the true log-sum-exp: ``exp(z) / s``
    on the local classes. With the class axis split the output is a partial sum: the first
    rank of the class-split mesh dims holds ``log(s)``, the others 0. Its gradient is then
    ``B`` (every rank holds the whole upstream gradient, the dual of ``P``), so each rank's
    gradient of its logits is local: the backward needs no all-reduce (DTensor's
    ``loss_parallel`` does the same)."""
    e = z.exp().sum(-1)
    # value 0, gradient exp(z) / s: the log-sum-exp's derivative, through the local classes
    grad_path = (e - e.detach()) / s
    if ctx is not None:
        last = len(ctx.in_shapes[0]) - 1
        if any(c != 0 for c, sbp in zip(ctx.coord, ctx.ins[0])
               if isinstance(sbp, Split) and sbp.axis == last):
            return grad_path
    return s.log() + grad_path


register("class_logsumexp", _class_logsumexp, class_logsumexp_signatures, context=True,
         doc="log of a row's all-reduced exp-sum (cross-entropy, classes split: a partial "
             "sum whose backward is local)")
