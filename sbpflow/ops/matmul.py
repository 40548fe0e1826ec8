"""matmul (batched, with torch's broadcasting) and linear (``x @ w.T + b``, ``w`` of shape
(out, in) as in torch), with OneFlow's signatures: rows, columns, the reduced dim (partial
output), a batch dim, partial operands kept partial. See docs/internals.md, 'Matmul signatures'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import Signature, TensorMeta, register

__all__ = ["matmul_signatures", "linear_signatures"]


def _batch_signatures(metas: list[TensorMeta], out_batch: tuple, core: list[int]) -> list:
    """For each output batch axis: split it in every input that has it (not broadcast)."""
    sigs = []
    for i in range(len(out_batch)):
        ins = []
        for m, c in zip(metas, core):
            nb = m.ndim - c  # batch dims of this input
            ax = i - (len(out_batch) - nb)
            ins.append(f"S({ax})" if ax >= 0 and m.shape[ax] == out_batch[i] else "B")
        sigs.append(Signature(ins, [f"S({i})"]))
    return sigs


def matmul_signatures(a: TensorMeta, b: TensorMeta) -> list[Signature]:
    if a.ndim == 0 or b.ndim == 0:
        return [Signature(["B", "B"], ["B"])]
    a_k = a.ndim - 1
    a_n = a.ndim - 2 if a.ndim >= 2 else None
    b_k = b.ndim - 2 if b.ndim >= 2 else 0
    b_m = b.ndim - 1 if b.ndim >= 2 else None
    a_batch = a.shape[:-2] if a.ndim > 2 else ()
    b_batch = b.shape[:-2] if b.ndim > 2 else ()
    out_batch = tuple(torch.broadcast_shapes(a_batch, b_batch))
    out_ndim = len(out_batch) + (a_n is not None) + (b_m is not None)
    sigs = []
    if a_n is not None:
        out_n = len(out_batch)
        sigs.append(Signature([f"S({a_n})", "B"], [f"S({out_n})"]))
    if b_m is not None:
        sigs.append(Signature(["B", f"S({b_m})"], [f"S({out_ndim - 1})"]))
    sigs += [Signature([f"S({a_k})", f"S({b_k})"], ["P"]),
             Signature(["P", "B"], ["P"]), Signature(["B", "P"], ["P"])]
    sigs += _batch_signatures([a, b], out_batch, [min(a.ndim, 2), min(b.ndim, 2)])
    sigs.append(Signature(["B", "B"], ["B"]))
    return sigs


register("matmul", torch.matmul, matmul_signatures, same_dtype=True)


def linear_signatures(x: TensorMeta, w: TensorMeta, b: TensorMeta | None = None) -> list[Signature]:
    """``x`` (..., in), ``w`` (out, in), ``b`` (out,)."""
    last = x.ndim - 1
    with_bias = isinstance(b, TensorMeta)

    def sig(sx, sw, sb, out):
        return Signature([sx, sw] + ([sb] if with_bias else []), [out])

    sigs = [sig(f"S({i})", "B", "B", f"S({i})") for i in range(last)]  # batch / sequence dims
    sigs += [sig("B", "S(0)", "S(0)", f"S({last})"),  # column parallel: split out features
             sig(f"S({last})", "S(1)", "P", "P"),      # row parallel: split in features
             sig("P", "B", "P", "P"), sig("B", "P", "P", "P"),
             sig("B", "B", "B", "B")]
    return sigs


register("linear", F.linear, linear_signatures, same_dtype=True)
