"""Normalisation ops: batch norm in four parts (per-rank statistics, normalise, eval, running
statistics update), ``group_norm`` and ``rms_norm``.

Batch norm's statistics are sums, so a batch (or spatial) split gives partial sums: reducing
them (one all-reduce of a (2, C) tensor) is SyncBatchNorm, and the dual of that boxing makes
the backward exact. Channels are independent: a channel split runs locally. See
docs/internals.md, 'Normalisation layers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import Signature, TensorMeta, register

__all__ = ["batch_norm_stats_signatures", "batch_norm_signatures",
           "batch_norm_update_signatures", "group_norm_signatures", "rms_norm_signatures",
           "stats_dtype", "SUMS_DTYPE"]


def _present(*ts) -> int:
    """How many of ``ts`` are tensor inputs (optional ones are None)."""
    return sum(isinstance(t, TensorMeta) for t in ts)


def _channel_shape(x: torch.Tensor) -> tuple:
    """The shape a per-channel (C,) vector broadcasts to against ``x`` (N, C, *)."""
    return (-1,) + (1,) * (x.ndim - 2)


def _connected(out: torch.Tensor, *inputs) -> torch.Tensor:
    """``out`` plus a zero that depends on every float tensor input (an empty shard stays in
    the autograd graph, so its rank's backward joins the collectives of the others)."""
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            out = out + t.reshape(-1)[:0].sum()
    return out


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a pass over an input of ``dtype`` computes statistics in: float32 for 16-bit
    inputs (as torch's kernels accumulate), else the input's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# The per-channel sums of batch norm are combined across ranks in float64: they are 2 x C
# numbers, and the variance read from them (s1/n - (s0/n)^2) cancels digits when the mean is
# far from the shift; float32 sums lost 6% of the variance at mean/std = 1000.
SUMS_DTYPE = torch.float64


# -- batch norm: the statistics ------------------------------------------------------------------
class _ShiftedSums(torch.autograd.Function):
    """``[Σ(x - k), Σ(x - k)²]`` per channel over every axis but 1, as a (2, C) float64 tensor.
    Both are sums, so ranks holding parts of the batch add them (a partial sum). ``k`` is a
    per-channel shift the same on every rank (the running mean, or 0). Computed from the
    rank's own mean and squared deviations (two passes over x, in `stats_dtype`: no
    cancellation here); the backward is one pass: ``dx = ds0 + 2 (x - k) ds1``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, k: torch.Tensor | None) -> torch.Tensor:
        acc = stats_dtype(x.dtype)
        c = x.shape[1]
        # k is the running mean, which the update writes in place after this op: keep a copy
        ctx.save_for_backward(x, None if k is None else k.clone())
        if x.numel() == 0:
            return torch.zeros(2, c, dtype=SUMS_DTYPE, device=x.device)
        dims = (0,) + tuple(range(2, x.ndim))
        n = x.numel() // c
        xa = x if x.dtype == acc else x.to(acc)
        mean = xa.mean(dims)
        dev = xa - mean.view(_channel_shape(x))
        m2 = (dev * dev).sum(dims).to(SUMS_DTYPE)
        d = mean.to(SUMS_DTYPE)
        if k is not None:
            d = d - k.to(SUMS_DTYPE)
        return torch.stack([d * n, m2 + d * d * n])

    @staticmethod
    def backward(ctx, ds: torch.Tensor):
        x, k = ctx.saved_tensors
        shape = _channel_shape(x)
        a = 2 * ds[1]
        base = ds[0] if k is None else ds[0] - a * k.to(ds.dtype)
        acc = stats_dtype(x.dtype)   # the full-size pass stays in x's precision
        dx = torch.addcmul(base.to(acc).view(shape), x, a.to(acc).view(shape))
        return dx.to(x.dtype), None


def batch_norm_stats_signatures(x: TensorMeta, k: TensorMeta | None = None) -> list[Signature]:
    """Batch / spatial split: partial sums; channel split: the channels' sums."""
    extra = _present(k)
    sigs = [Signature([f"S({a})"] + ["B"] * extra, ["P"]) for a in range(x.ndim) if a != 1]
    sigs.append(Signature(["S(1)"] + ["S(0)"] * extra, ["S(1)"]))
    sigs.append(Signature(["B"] * (1 + extra), ["B"]))
    return sigs


def _batch_norm_stats(x, k=None):
    return _ShiftedSums.apply(x, k)


register("batch_norm_stats", _batch_norm_stats, batch_norm_stats_signatures,
         doc="per-channel [sum(x - k), sum((x - k)^2)] as (2, C); batch split: partial sums")


# -- batch norm: normalise with the logical statistics -----------------------------------------
def _mean_var(s: torch.Tensor, k: torch.Tensor | None, count: int) -> tuple:
    """Mean and biased variance (float64) from the shifted sums of ``count`` values a
    channel."""
    d = s[0] / count
    mean = d if k is None else d + k.to(d.dtype)
    return mean, (s[1] / count - d * d).clamp_min(0)


class _Normalize(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps) * w + b`` with given per-channel ``mean`` and ``var``:
    torch's fused eval-mode kernels, plus the gradients of ``mean`` and ``var`` (which torch's
    kernel does not give: they flow on to the statistics, and from them to every rank's x)."""

    @staticmethod
    def forward(ctx, x, mean, var, w, b, eps: float):
        ctx.save_for_backward(x, mean, var, w)
        ctx.eps = eps
        if x.numel() == 0:  # torch's backward kernel divides by zero on an empty batch
            return x.clone()
        return torch.ops.aten.native_batch_norm(x, w, b, mean, var, False, 0.0, eps)[0]

    @staticmethod
    def backward(ctx, g):
        x, mean, var, w = ctx.saved_tensors
        if x.numel() == 0:
            z = mean.new_zeros(mean.shape)
            gw = None if w is None else torch.zeros_like(w)
            return torch.zeros_like(x), z, z, gw, None if gw is None else gw.clone(), None
        gx, gxhat, gb = torch.ops.aten.native_batch_norm_backward(
            g, x, w, mean, var, None, None, False, ctx.eps, [True, True, True])
        # gxhat = Σ g·x̂ and gb = Σ g per channel (the weight's and bias's gradients)
        invstd = torch.rsqrt(var + ctx.eps)
        scale = invstd if w is None else invstd * w
        gmean = -gb * scale
        gvar = -0.5 * gxhat * scale * invstd
        return gx, gmean, gvar, (None if w is None else gxhat), (None if w is None else gb), None


def batch_norm_signatures(x: TensorMeta, a: TensorMeta, b2: TensorMeta | None = None,
                          w: TensorMeta | None = None, b: TensorMeta | None = None,
                          after: TensorMeta | None = None, **_attrs) -> list[Signature]:
    """Per-channel vectors (statistics, running stats, weight, bias) follow the channels: all
    ``B`` beside a batch / spatial split, split with a channel split. ``a`` is (2, C) shifted
    sums (channels on its axis 1) or the (C,) running mean; ``b2`` the shift or running var;
    ``after`` (0-d, replicated) the running statistics update's result."""
    vec_split = "S(1)" if a.ndim == 2 else "S(0)"
    vecs = [vec_split] + ["S(0)"] * _present(b2, w, b)
    n, tail = len(vecs), ["B"] * _present(after)
    sigs = [Signature([f"S({ax})"] + ["B"] * n + tail, [f"S({ax})"])
            for ax in range(x.ndim) if ax != 1]
    sigs.append(Signature(["S(1)"] + vecs + tail, ["S(1)"]))
    sigs.append(Signature(["B"] * (1 + n) + tail, ["B"]))
    return sigs


def _batch_norm_train(x, s, k=None, w=None, b=None, after=None, count: int = 1,
                      eps: float = 1e-5):
    """``after``: read only so that the running statistics update is ordered before this op
    and, in a graph, kept (a graph runs only the ops its outputs need)."""
    mean, var = _mean_var(s, k, count)
    acc = stats_dtype(x.dtype)
    return _Normalize.apply(x, mean.to(acc), var.to(acc), w, b, eps)


def _batch_norm_eval(x, running_mean, running_var, w=None, b=None, eps: float = 1e-5):
    if x.numel() == 0:
        return _connected(x.clone(), w, b)
    return F.batch_norm(x, running_mean, running_var, w, b, False, 0.0, eps)


register("batch_norm_train", _batch_norm_train, batch_norm_signatures,
         doc="normalise x with the statistics of its logical batch (shifted sums, all-reduced "
             "by the caller); gradients reach every rank's x through the sums")
register("batch_norm_eval", _batch_norm_eval, batch_norm_signatures,
         doc="normalise x with the running statistics (torch's eval-mode batch_norm)")


# -- batch norm: the running statistics ------------------------------------------------------
def batch_norm_update_signatures(running_mean: TensorMeta, running_var: TensorMeta,
                                 s: TensorMeta, nbt: TensorMeta | None = None,
                                 count: int = 2, momentum: float | None = 0.1) -> list[Signature]:
    extra = ["B"] * _present(nbt)
    return [Signature(["B", "B", "B"] + extra, ["B"]),
            Signature(["S(0)", "S(0)", "S(1)"] + extra, ["B"])]


def _batch_norm_update(running_mean, running_var, s, nbt=None, count: int = 2,
                       momentum: float | None = 0.1):
    """Update the running statistics IN PLACE from the logical batch's shifted sums ``s``
    (shifted by ``running_mean`` itself), as torch: the variance unbiased (``n / (n - 1)``);
    ``nbt`` (num_batches_tracked) counts the batch, and with ``momentum=None`` the factor is
    ``1 / nbt`` (a cumulative average). Returns a dummy 0-d zero. The dispatch is told to
    keep the buffers' own layouts (so the kernel writes into the buffers' shards)."""
    with torch.no_grad():
        mean, var = _mean_var(s, running_mean, count)
        var = var * (count / (count - 1))
        if nbt is not None:
            nbt.add_(1)
        factor = momentum if momentum is not None else 1.0 / nbt.to(torch.float64)
        running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype) * factor)
        running_var.mul_(1 - factor).add_(var.to(running_var.dtype) * factor)
    return s.new_zeros(())


register("batch_norm_update_", _batch_norm_update, batch_norm_update_signatures,
         doc="in-place update of the running mean / var (and num_batches_tracked) from the "
             "logical batch's statistics")


# -- group norm ------------------------------------------------------------------------------
def group_norm_signatures(x: TensorMeta, w: TensorMeta | None = None,
                          b: TensorMeta | None = None, num_groups: int = 1,
                          eps: float = 1e-5) -> list[Signature]:
    """Each (sample, group) is normalised alone: batch splits and splits into whole groups of
    channels (checked by the context kernel) are local."""
    n = _present(w, b)
    return [Signature(["S(0)"] + ["B"] * n, ["S(0)"]),
            Signature(["S(1)"] + ["S(0)"] * n, ["S(1)"]),
            Signature(["B"] * (1 + n), ["B"])]


def _group_norm(x, w=None, b=None, num_groups: int = 1, eps: float = 1e-5, *, ctx=None):
    """torch's group_norm on the local shard; with the channels split, on the groups this rank
    holds. A shard that does not hold whole groups raises ValueError, which the registry's
    local-shape check reads as "not valid here" (the input is boxed instead)."""
    groups = num_groups
    if ctx is not None:
        channels = ctx.in_shapes[0][1]
        start, size = ctx.in_boxes[0][1]
        per = channels // num_groups
        if start % per or size % per:
            raise ValueError(f"group_norm: channels [{start}, {start + size}) are not whole "
                             f"groups of {per}")
        groups = size // per
        if groups == 0:
            return _connected(x.clone(), w, b)
    return F.group_norm(x, groups, w, b, eps)


register("group_norm", _group_norm, group_norm_signatures, context=True,
         doc="torch's group_norm; batch split or whole groups of channels per rank")


# -- rms norm --------------------------------------------------------------------------------
def rms_norm_signatures(x: TensorMeta, normalized_shape=(), w: TensorMeta | None = None,
                        eps: float | None = None) -> list[Signature]:
    """As layer_norm's: leading axes split, the normalised ones whole; linear in the weight."""
    lead = x.ndim - len(tuple(normalized_shape))
    n = _present(w)
    sigs = [Signature([f"S({a})"] + ["B"] * n, [f"S({a})"]) for a in range(lead)]
    if n:
        sigs.append(Signature(["B", "P"], ["P"]))
    sigs.append(Signature(["B"] * (1 + n), ["B"]))
    return sigs


def _rms_norm(x, normalized_shape, w=None, eps=None):
    return F.rms_norm(x, tuple(normalized_shape), w, eps)


register("rms_norm", _rms_norm, rms_norm_signatures,
         doc="torch's rms_norm over the trailing normalized_shape (those axes whole on a rank)")
