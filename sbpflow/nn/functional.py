"""``sf.nn.functional``: torch.nn.functional's names on global tensors.

Functions are either one registered op (``apply_op``) or compositions of ops whose layouts fall
out of the ops' signatures (e.g. softmax along a split axis: local max, all-reduce max, local
exp-sum, all-reduce sum — written as plain tensor code on global tensors).
"""

from __future__ import annotations

import math

import torch

from ..errors import DtypeMismatchError, GraphError, IndexOutOfRange, ShapeError
from ..ops.nn_ops import (check_index_range, count_dtype, id_out_of_range,
                          target_out_of_range)
from ..sbp import B, Broadcast, Partial, Split, format_nd_sbp
from ..tensor import (GlobalTensor, _next_seed, apply_op, current_recorder, errors_as, fresh,
                      full, guard, lifting_plain_tensors)
from .eager_count_mean import mean_over_count, weighs_means
from .functional_norm import batch_norm, group_norm, rms_norm

__all__ = ["linear", "relu", "gelu", "tanh", "sigmoid", "silu", "softmax", "log_softmax",
           "layer_norm", "embedding", "cross_entropy", "dropout", "scaled_dot_product_attention"]
__all__ += ["batch_norm", "group_norm", "rms_norm"]  # sbpflow/nn/functional_norm.py
__all__ += ["leaky_relu", "elu", "softplus", "normalize", "one_hot", "nll_loss"]


@lifting_plain_tensors
def linear(x: GlobalTensor, weight: GlobalTensor, bias: GlobalTensor | None = None) -> GlobalTensor:
    """``x @ weight.T + bias`` with ``weight`` of shape (out, in), as ``torch.nn.functional``."""
    return apply_op("linear", x, weight) if bias is None else apply_op("linear", x, weight, bias)


def relu(x: GlobalTensor) -> GlobalTensor:
    """torch's ``F.relu``, elementwise: the result keeps ``x``'s layout."""
    return apply_op("relu", x)


def gelu(x: GlobalTensor, approximate: str = "none") -> GlobalTensor:
    """torch's ``F.gelu`` (``approximate='none'`` or ``'tanh'``), elementwise."""
    return apply_op("gelu", x, approximate=approximate) if approximate != "none" else apply_op("gelu", x)


def tanh(x: GlobalTensor) -> GlobalTensor:
    """torch's ``F.tanh``, elementwise."""
    return apply_op("tanh", x)


def sigmoid(x: GlobalTensor) -> GlobalTensor:
    """torch's ``F.sigmoid``, elementwise."""
    return apply_op("sigmoid", x)


def silu(x: GlobalTensor) -> GlobalTensor:
    """torch's ``F.silu``, elementwise."""
    return apply_op("silu", x)


# -- activations, normalising and losses written as compositions of elementwise ops ----------
def leaky_relu(x: GlobalTensor, negative_slope: float = 0.01) -> GlobalTensor:
    """torch's ``F.leaky_relu``, elementwise."""
    return apply_op("where", x > 0, x, x * negative_slope)


def elu(x: GlobalTensor, alpha: float = 1.0) -> GlobalTensor:
    """torch's ``F.elu``, elementwise."""
    return apply_op("where", x > 0, x, x.clamp(max=0).expm1() * alpha)


def softplus(x: GlobalTensor, beta: float = 1.0, threshold: float = 20.0) -> GlobalTensor:
    """``log(1 + exp(beta x)) / beta``, linear where ``beta x > threshold``, as torch."""
    bx = x * beta
    return apply_op("where", bx > threshold, x, bx.clamp(max=threshold).exp().log1p() / beta)


def normalize(x: GlobalTensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> GlobalTensor:
    """``x / max(||x||_p, eps)`` along ``dim`` (a split ``dim`` gives a partial norm, reduced)."""
    norm = (x.abs() ** p).sum(dim, keepdim=True) ** (1.0 / p)
    return x / norm.clamp(min=eps)


def one_hot(target: GlobalTensor, num_classes: int = -1) -> GlobalTensor:
    """int64 one-hot rows of ``target`` (``num_classes=-1``: the largest class + 1, read with a
    collective, as torch reads it from the values)."""
    if num_classes < 0:
        num_classes = int(target.max().item()) + 1
    classes = torch.arange(num_classes, device=target.device)
    return apply_op("eq", target.unsqueeze(-1), classes).to(torch.int64)


@lifting_plain_tensors
def nll_loss(input: GlobalTensor, target: GlobalTensor, weight: GlobalTensor | None = None,
             ignore_index: int = -100, reduction: str = "mean") -> GlobalTensor:
    """``torch.nn.functional.nll_loss``: minus ``input`` (log-probabilities) at each target
    class, with torch's shapes (classes on axis 1 from two dims on), class ``weight``,
    ``ignore_index`` and ``reduction`` (a mean divides by the summed weights of the targets
    kept); the target pick of `cross_entropy`, so any layout of the classes works."""
    input, _ = _cross_entropy_inputs(input, target, weight, reduction, 0.0)
    ignore_index = int(ignore_index)
    pick = {"ignore_index": ignore_index}
    if _check_sliced_target(input, target, ignore_index):
        pick["checked"] = True
    if reduction == "mean":
        _check_counted_mean(weight, "nll_loss")
    picked = apply_op("pick_class", input, target, **pick)
    if weight is None:
        row_weight = apply_op("ne", target, ignore_index).to(input.dtype)
    else:
        row_weight = apply_op("pick_class", weight.expand(*input.shape), target,
                              **{**pick, "checked": True})
    loss = -picked * row_weight
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    count = row_weight.to(count_dtype(row_weight.dtype)).sum()
    return mean_over_count(loss.sum(), count, ("nll_loss", tuple(target.shape), target.sbp,
                                               ignore_index, weight is not None),
                           None if weight is not None else float(target.numel()))


# -- transformer ops ------------------------------------------------------------------------------
# Composites along a split axis reduce locally, then box the partial result to broadcast: that
# boxing is the all-reduce (and its dual backward the all-reduce of the gradient).

def _norm_dim(dim: int, x: GlobalTensor, what: str) -> int:
    """``dim`` of ``x`` as a non-negative axis; out of range (torch's IndexError) it is a
    `ShapeError` naming ``x``'s layout."""
    ndim = x.ndim
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < max(ndim, 1):
        raise ShapeError(f"{what}: dim {dim} is out of range for a tensor with {ndim} "
                         f"dimension(s) (expected in [{-max(ndim, 1)}, {max(ndim, 1) - 1}]); "
                         f"{_layouts(('input', x))}")
    return d


def _split_on(x: GlobalTensor, axes) -> bool:
    """Whether some mesh dim splits ``x`` on one of ``axes``."""
    return any(isinstance(s, Split) and s.axis in axes for s in x.sbp)


def _reduced(t: GlobalTensor) -> GlobalTensor:
    """``t`` with every partial mesh dim reduced (P -> B: the all-reduce)."""
    nd = tuple(B if isinstance(s, Partial) else s for s in t.sbp)
    return t if nd == t.sbp else t.to_global(sbp=nd)


def _max_over(x: GlobalTensor, dim: int) -> GlobalTensor:
    """The max along ``dim`` (keepdim), replicated across the ranks splitting it, no gradient:
    local max -> P(max) -> B."""
    return _reduced(x.detach().amax(dim=dim, keepdim=True))


def _sum_over(x: GlobalTensor, dims, keepdim: bool = True) -> GlobalTensor:
    """The sum along ``dims`` replicated across the ranks splitting them: local sum -> P -> B."""
    return _reduced(x.sum(dim=dims, keepdim=keepdim))


def softmax(x: GlobalTensor, dim: int, dtype: torch.dtype | None = None) -> GlobalTensor:
    """``torch.softmax`` along ``dim``. Along an unsplit axis: the local op (no communication).
    Along a split axis: local max, all-reduce max, exp, local sum, all-reduce sum, divide."""
    if dtype is not None:
        x = x.to(dtype)
    d = _norm_dim(dim, x, "softmax")
    if not _split_on(x, (d,)):
        return apply_op("softmax", x, d)
    e = (x - _max_over(x, d)).exp()
    return e / _sum_over(e, d)


def log_softmax(x: GlobalTensor, dim: int, dtype: torch.dtype | None = None) -> GlobalTensor:
    """``torch.log_softmax`` along ``dim`` (along a split axis: as `softmax`, then
    ``z - log(sum(exp(z)))`` with ``z = x - max``)."""
    if dtype is not None:
        x = x.to(dtype)
    d = _norm_dim(dim, x, "log_softmax")
    if not _split_on(x, (d,)):
        return apply_op("log_softmax", x, d)
    z = x - _max_over(x, d)
    return z - _sum_over(z.exp(), d).log()


@lifting_plain_tensors
def layer_norm(x: GlobalTensor, normalized_shape, weight: GlobalTensor | None = None,
               bias: GlobalTensor | None = None, eps: float = 1e-5) -> GlobalTensor:
    """``torch.nn.functional.layer_norm``. With the normalized axes whole on each rank: the local
    op. With one of them split (hidden-dim tensor parallelism): mean and variance by local sums
    all-reduced across the splitting ranks (two passes, as torch), weight and bias following the
    split (a weight laid out ``S(0)`` along a split hidden dim needs no communication)."""
    ns = (int(normalized_shape),) if isinstance(normalized_shape, int) else \
        tuple(int(n) for n in normalized_shape)
    shape = x._shape
    if len(ns) > len(shape) or shape[len(shape) - len(ns):] != ns:
        raise ShapeError(f"layer_norm: normalized_shape {ns} does not match the trailing dims of "
                         f"input shape {tuple(x.shape)} (placement {x.placement}, sbp {x.sbp})")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != ns:  # checked here: a split hidden dim composes
            shown = _layouts(("input", x), (name, t))
            raise ShapeError(f"layer_norm: {name} of shape {tuple(t.shape)} must have the "
                             f"normalized_shape {ns}, as in torch; {shown}")
    dims = tuple(range(x.ndim - len(ns), x.ndim))
    if not _split_on(x, dims):
        return apply_op("layer_norm", x, ns, weight, bias, float(eps))
    n = math.prod(ns)
    xc = x - _sum_over(x, dims) / n
    var = _sum_over(xc * xc, dims) / n
    y = xc * (var + eps).rsqrt()
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


@lifting_plain_tensors
def embedding(input: GlobalTensor, weight: GlobalTensor, padding_idx: int | None = None,
              max_norm=None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
              sparse: bool = False) -> GlobalTensor:
    """Rows of ``weight`` (vocab, dim) at the integer ``input``. Layouts: ids split on a batch
    axis with a replicated table; the table split on dim (output split on its last axis); the
    table split on vocab (Megatron's VocabParallelEmbedding: each rank looks up only its rows,
    the output is a partial sum)."""
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise NotImplementedError("embedding: max_norm, scale_grad_by_freq and sparse are not "
                                  "supported")
    if padding_idx is not None:
        vocab = weight.shape[0]
        if not -vocab <= padding_idx < vocab:
            raise ShapeError(f"embedding: padding_idx {padding_idx} out of range for a table "
                             f"of {vocab} rows")
        padding_idx = padding_idx + vocab if padding_idx < 0 else padding_idx
    pad = () if padding_idx is None else (padding_idx,)
    if _check_replicated_ids(input, weight):
        return apply_op("embedding", input, weight, *pad, checked=True)
    return apply_op("embedding", input, weight, *pad)


def _check_replicated_ids(ids: GlobalTensor, weight: GlobalTensor) -> bool:
    """Ids replicated on a mesh dim where the table is split by rows or partial: the lookup's
    output is partial, and the signature choice may slice the ids on another mesh dim (a
    partial output over fewer rows costs less to reduce later) or move a table that is not a
    parameter instead: check the ids whole here (a local min/max pass, no collective), so every
    rank sharing them raises `IndexOutOfRange` together. Returns True if checked: the kernel
    skips its own check (every rank checked its ids, so a bad id stops every rank holding it
    before the op's boxing, and no kernel sees an unchecked id). Other layouts keep replicated
    ids whole (nothing gains from slicing them) and torch's lookup checks them."""
    for i, w in zip(ids.sbp, weight.sbp):
        if isinstance(i, Broadcast) and (isinstance(w, Partial) or
                                         (isinstance(w, Split) and w.axis == 0)):
            break
    else:
        return False
    vocab = weight.shape[0]
    where = _layouts_later(("ids", ids), ("weight", weight))
    guard(ids, lambda local: check_index_range(local, vocab, None, lambda: id_out_of_range(
        local, vocab, where())))
    return True


@lifting_plain_tensors
def cross_entropy(input: GlobalTensor, target: GlobalTensor, weight: GlobalTensor | None = None,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> GlobalTensor:
    """Cross-entropy of ``input`` logits against integer class ``target``, with torch's shapes:
    logits (C,), (N, C) or (N, C, d1, ...) — the class axis is axis 1 from two dims on — and
    target (), (N,) or (N, d1, ...). Equals ``torch.nn.functional.cross_entropy`` for the same
    arguments (for 3-D+ logits the class axis is moved last first, a local permute).

    Works for every layout: batch-split logits stay split until the final sum; class-split logits
    (model-parallel softmax) all-reduce only the max and the exp-sum of each row, and the target
    logit is picked by the rank owning its class (a partial sum). With the classes whole on each
    rank and neither ``weight`` nor ``label_smoothing``, each row is torch's fused kernel.
    ``weight``: a global (C,) tensor of class weights (row i counts ``weight[target_i]``);
    ``label_smoothing`` ε: row loss ``(1-ε)·w[t]·nll + ε/C·Σ_c w_c·(-log p_c)``, as torch.
    ``reduction``: "mean" (divided by the summed weights of the targets not equal to
    ``ignore_index``: their count without ``weight``), "sum" or "none" (shape of ``target``).
    A mean whose count is summed over ranks may come back as a `PendingMean`
    (``sbpflow/nn/eager_count_mean.py``): a global tensor whose count's all-reduce is still in
    flight, so the forward does not wait for it; reading it waits, backward need not."""
    input, n_classes = _cross_entropy_inputs(input, target, weight, reduction, label_smoothing)
    c = input.ndim - 1
    ignore_index = int(ignore_index)
    if reduction == "mean":
        _check_counted_mean(weight, "cross_entropy")
    # classes whole on every rank, plain loss: torch's fused kernels on the rows
    plain_rows = weight is None and not label_smoothing and not _split_on(input, (c,))
    if plain_rows and reduction != "none" and target.sbp == input.sbp:
        if reduction == "mean" and all(isinstance(s, Broadcast) for s in input.sbp) and \
                not weighs_means():
            # every rank holds every row (one device included): torch's mean, one kernel. (A
            # graph weighting micro-batches by their rows needs the count: below)
            return _row_op("cross_entropy_mean", input, target, ignore_index)
        # rows laid out alike: one kernel gives the summed row losses and the valid-target
        # count. A replicated target with split logits goes the way below: its count is then
        # replicated, where the fused count would be partial (an all-reduce)
        total, count = _row_op("cross_entropy_sum", input, target, ignore_index)
        if reduction == "sum":
            return total
        return mean_over_count(total, count, ("cross_entropy", tuple(target.shape),
                                              target.sbp, ignore_index), float(target.numel()))
    checked = _check_sliced_target(input, target, ignore_index)
    if input.dtype in (torch.float16, torch.bfloat16) and \
            torch.is_autocast_enabled(input.placement.device_type):
        input = input.float()  # autocast runs torch's cross-entropy in float32: so do its parts
    valid = apply_op("ne", target, ignore_index).to(input.dtype)
    if plain_rows:
        loss = _row_op("row_cross_entropy", input, target, ignore_index)
        row_weight = valid
    else:
        loss, row_weight = _class_pick_rows(input, target, weight, valid, ignore_index, checked,
                                            label_smoothing)
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    count = row_weight.to(count_dtype(row_weight.dtype)).sum()
    return mean_over_count(total, count, ("cross_entropy", tuple(target.shape), target.sbp,
                                          ignore_index, weight is not None),
                           None if weight is not None else float(target.numel()))


def _cross_entropy_inputs(input: GlobalTensor, target: GlobalTensor, weight, reduction: str,
                          label_smoothing: float) -> tuple[GlobalTensor, int]:
    """Check `cross_entropy`'s arguments; return the logits with the classes on the last axis
    (a local permute of torch's (N, C, d1, ...)) and the number of classes."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', not "
                         f"{reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if target.dtype.is_floating_point:
        raise _float_target(input, target)
    if input.ndim >= 3:  # torch: (N, C, d1, ...); classes last is the form computed below
        expect = (input.shape[0],) + tuple(input.shape[2:])
        if tuple(target.shape) != expect:
            raise ShapeError(f"cross_entropy: logits of shape {tuple(input.shape)} (classes on "
                             f"axis 1, as torch) need a target of shape {expect}, got "
                             f"{tuple(target.shape)} (placement {input.placement}, sbp "
                             f"{input.sbp}); for (B, T, C) logits pass "
                             f"logits.reshape(-1, C) and target.reshape(-1)")
        input = input.permute(0, *range(2, input.ndim), 1)
    if input.ndim < 1 or tuple(target.shape) != tuple(input.shape[:-1]):
        raise ShapeError(f"cross_entropy: target of shape {tuple(target.shape)} does not match "
                         f"logits of shape {tuple(input.shape)} (placement {input.placement}, "
                         f"sbp {input.sbp})")
    n_classes = input.shape[-1]
    if weight is not None:
        if not isinstance(weight, GlobalTensor):
            raise TypeError("cross_entropy: weight must be an sf global tensor (e.g. "
                            "sf.tensor(w, placement, sbp=sf.B))")
        if tuple(weight.shape) != (n_classes,):
            raise ShapeError(f"cross_entropy: weight of shape {tuple(weight.shape)} for "
                             f"{n_classes} classes (logits {tuple(input.shape)}, placement "
                             f"{input.placement}, sbp {input.sbp})")
    return input, n_classes


def _check_counted_mean(weight, what: str) -> None:
    """In a graph that weights each micro-batch's mean loss by its share of the batch's rows
    (gradient accumulation), a mean over the targets kept is corrected to the whole batch's
    count at the end (`sbpflow.nn.graph_count_mean`), by scaling: class weights that learn make
    the count differentiable, which scaling cannot undo, so they are refused."""
    rec = current_recorder()
    if rec is None or not rec.weighs_means or weight is None or not weight.requires_grad:
        return
    raise GraphError(
        f"graph: a mean {what} with class weights that require grad over "
        f"{rec.micro_batches} micro-batches: the batch's mean divides by the whole batch's "
        f"summed weights, a differentiable count graph mode does not compute across "
        f"micro-batches. Sum instead: config.set_loss_reduction('sum') and "
        f"{what}(..., reduction='sum') / n, n the batch's summed weights of kept targets "
        f"(docs/runtime.md, 'Graph mode'); or set_gradient_accumulation_steps(1)")


def _float_target(logits: GlobalTensor, target: GlobalTensor) -> Exception:
    """The error for a floating-point target: class probabilities (the logits' shape), which
    sbpflow does not support, or class indices of a float dtype, which torch refuses too
    ("expected scalar type Long")."""
    shown = _layouts(("logits", logits), ("target", target))
    if tuple(target.shape) == tuple(logits.shape):
        return NotImplementedError(f"cross_entropy: class-probability targets are not supported, "
                                   f"only integer class indices; {shown}")
    return DtypeMismatchError(f"cross_entropy: class-index targets must have an integer dtype "
                              f"(torch: expected scalar type Long), got {target.dtype}; {shown}")


def _class_pick_rows(input: GlobalTensor, target: GlobalTensor, weight, valid: GlobalTensor,
                     ignore_index: int, checked: bool, label_smoothing: float) -> tuple:
    """Row losses and row weights from a log-sum-exp and the pick of each target's logit
    (class-split logits: only the row max and exp-sum are all-reduced, in forward; the
    log-sum-exp and the target logit are partial sums whose gradients are local, so backward
    all-reduces nothing), with class weights and label smoothing."""
    c = input.ndim - 1
    n_classes = input.shape[c]
    pick = {"ignore_index": ignore_index}
    if checked:  # the class pick's own target check is skipped: done by the caller
        pick["checked"] = True
    z = input - _max_over(input, c)
    lse = apply_op("class_logsumexp", z, _sum_over(z.detach().exp(), c, keepdim=False))
    picked = apply_op("pick_class", z, target, **pick)
    if weight is None:
        row_weight = valid
    else:
        w_rows = weight.expand(*input.shape)        # class weights along the logits
        # the first pick checked every row's target
        row_weight = apply_op("pick_class", w_rows, target, **{**pick, "checked": True})
    loss = (lse - picked) * row_weight
    if label_smoothing:
        # Σ_c w_c·(lse - z_c): the cross-entropy against the uniform distribution
        if weight is None:
            smooth = lse * float(n_classes) - z.sum(c)
        else:
            smooth = lse * weight.sum() - (z * w_rows).sum(c)
        loss = loss * (1.0 - label_smoothing) + smooth * valid * (label_smoothing / n_classes)
    return loss, row_weight


def _check_sliced_target(logits: GlobalTensor, target: GlobalTensor, ignore_index: int) -> bool:
    """A target replicated on a mesh dim where the classes are not split may reach the row
    kernel or the class pick sliced (the signature that slices it can be the cheapest, e.g.
    for split or partial logits rows): check it whole here, so every rank of that dim raises
    `IndexOutOfRange` together (a local min/max pass, no collective). With the classes split
    the class pick keeps the target whole and checks it; split targets are checked by the
    kernels, on the ranks holding them. (The fused path keeps both layouts as they are.)
    True if checked: every rank checked its target, so a bad one stops every rank holding it
    before the kernels' boxing, and no kernel sees an unchecked target."""
    classes = logits.ndim - 1
    for t, lg in zip(target.sbp, logits.sbp):
        if isinstance(t, Broadcast) and not (isinstance(lg, Split) and lg.axis == classes):
            break
    else:
        return False
    n = logits.shape[-1]
    where = _layouts_later(("logits", logits), ("target", target))
    guard(target, lambda local: check_index_range(local, n, ignore_index, lambda: (
        target_out_of_range(local, n, ignore_index, where()))))
    return True


def _row_op(name: str, logits: GlobalTensor, target: GlobalTensor, ignore_index: int):
    """Op ``name`` (torch's fused cross-entropy on rows holding every class). torch's kernel
    checks the targets it sees (its ``IndexError`` becomes `IndexOutOfRange`, naming the
    layouts): a replicated target is checked whole on every rank; split rows, by the ranks
    holding them (as DDP: the launcher stops the others)."""
    classes, where = logits.shape[-1], _layouts_later(("logits", logits), ("target", target))

    def translate(exc: Exception) -> IndexOutOfRange | None:
        if not isinstance(exc, IndexError) or isinstance(exc, IndexOutOfRange):
            return None
        return IndexOutOfRange(f"cross_entropy: {exc} {classes} classes (targets must lie in "
                               f"[0, {classes}) or equal ignore_index {ignore_index}); "
                               f"{where()}")

    with errors_as(translate):
        return apply_op(name, logits, target, ignore_index=ignore_index)


def _layouts_later(*named: tuple):
    """`_layouts` of the tensors' metadata as they are now, formatted when called (an error
    message a graph's value check may need on any later call: it keeps no tensor alive)."""
    meta = [(n, tuple(t.shape), t.sbp) for n, t in named]
    pl = named[0][1].placement

    def text() -> str:
        parts = [f"{n} of shape {shape} with sbp {format_nd_sbp(sbp)}" for n, shape, sbp in meta]
        return f"{', '.join(parts)} on {pl}"
    return text


def _layouts(*named: tuple) -> str:
    """``name of shape (..) with sbp (..)`` for each (name, global tensor), and the placement."""
    return _layouts_later(*named)()


def dropout(x: GlobalTensor, p: float = 0.5, training: bool = True, inplace: bool = False,
            seed: int | None = None) -> GlobalTensor:
    """``torch.nn.functional.dropout`` with a layout-independent mask: each rank draws only its
    region of one logical uniform tensor (``generate_region``), so the result is the same in
    every layout and on one device, for the same ``seed``. Without ``seed`` it comes from the
    per-rank stream of `sf.manual_seed` (agrees across ranks that call in the same order)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    def seed_tensor():  # a graph draws a new seed on every replay unless ``seed`` is given
        return full((), _next_seed(seed, None) % (1 << 63), placement=x.placement,
                    sbp=(B,) * x.placement.ndim, dtype=torch.int64)

    seed_t = seed_tensor() if seed is not None else fresh(seed_tensor)
    return apply_op("dropout", x, seed_t, p=float(p))


def _batch_or_head_layout(q: GlobalTensor, k: GlobalTensor, v: GlobalTensor) -> bool:
    """q, k, v share placement, leading shape and layout, split only on batch / head axes."""
    qs, ks, vs = q._shape, k._shape, v._shape
    lead = len(qs) - 2
    if not (len(qs) == len(ks) == len(vs) >= 2 and qs[:-2] == ks[:-2] == vs[:-2]
            and q.placement == k.placement == v.placement and q.sbp == k.sbp == v.sbp):
        return False
    return all(isinstance(s, Broadcast) or (isinstance(s, Split) and s.axis < lead)
               for s in q.sbp)


@lifting_plain_tensors
def scaled_dot_product_attention(query: GlobalTensor, key: GlobalTensor, value: GlobalTensor,
                                 attn_mask: GlobalTensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 seed: int | None = None) -> GlobalTensor:
    """``softmax(q @ k^T * scale [+ mask]) @ v`` on (..., T, D) tensors, from ops: with batch or
    heads split everything is local (no communication); a split key axis makes the softmax the
    split-axis composite. ``is_causal``: entries above the diagonal (top-left aligned, as torch)
    are masked. ``attn_mask``: boolean (True = attend) or additive float. ``dropout_p`` uses
    `dropout` (its own random stream: not torch's)."""
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: give attn_mask or is_causal, not both")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if attn_mask is None and dropout_p == 0.0 and _batch_or_head_layout(query, key, value):
        # every rank holds whole sequences: torch's fused kernel on the shards, no communication
        return apply_op("attention", query, key, value, is_causal=is_causal, scale=scale)
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        scores = apply_op("masked_fill_causal", scores)
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = apply_op("where", attn_mask, scores, float("-inf"))
        else:
            scores = scores + attn_mask
    attn = softmax(scores, -1) if attn_mask is None else _masked_softmax(scores)
    if dropout_p > 0.0:
        attn = dropout(attn, dropout_p, seed=seed)
    return attn @ value


def _masked_softmax(scores: GlobalTensor) -> GlobalTensor:
    """Softmax over the last axis, with zeros (and a zero gradient) in a row whose scores are
    all -inf, a query that may attend to no key (a padded position), as torch's attention
    (its ``_safe_softmax``); a plain softmax gives NaN there, in values and gradients."""
    live = ~(scores == float("-inf")).all(dim=-1, keepdim=True)
    return apply_op("where", live, softmax(apply_op("where", live, scores, 0.0), -1), 0.0)


def __getattr__(name: str):
    """The rest of ``torch.nn.functional`` (``mse_loss``, ``pad``, ...): torch's own function,
    which runs on global tensors through their ``__torch_function__`` (the table of
    `sbpflow.nn.torch_handlers`; one without an sbpflow version raises naming what to use)."""
    fn = getattr(torch.nn.functional, name, None)
    if fn is None or name.startswith("_"):
        raise AttributeError(f"module 'sbpflow.nn.functional' has no attribute {name!r} (nor "
                             f"has torch.nn.functional)")
    return fn
