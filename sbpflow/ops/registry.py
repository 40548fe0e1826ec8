"""The op registry: an op is one registration — a name, a local torch kernel, and a generator of
its valid 1-D signatures from the inputs' metadata.

Signatures are data (`Signature`), never computed from GlobalTensors; on an N-D mesh a
candidate is one 1-D signature per mesh dim, kept only if the kernel's local shapes fit, and
`choose` picks the cheapest valid one (the dispatch caches the choice). See docs/internals.md,
'The op registry'.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..boxing import plan_layouts
from ..caches import memoize
from ..errors import SbpError, ShapeError, SignatureError
from ..layouts import Layout
from ..placement import Placement
from ..sbp import B, Partial, Sbp, format_nd_sbp, parse_sbp, shard_box

__all__ = ["TensorMeta", "Signature", "Op", "register", "get_op", "choose", "Choice", "OPS",
           "out_metas", "hashable", "register_attr_type", "tensor_metas", "detaches",
           "KernelContext"]


@dataclass(frozen=True)
class TensorMeta:
    """What signature generators see of a tensor: its logical shape and dtype."""

    shape: tuple
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Signature:
    """One mesh dim's sbp for every tensor input (``ins``) and every output (``outs``)."""

    ins: tuple
    outs: tuple

    def __init__(self, ins: Sequence[Sbp | str], outs: Sequence[Sbp | str]) -> None:
        object.__setattr__(self, "ins", tuple(parse_sbp(s) for s in ins))
        object.__setattr__(self, "outs", tuple(parse_sbp(s) for s in outs))

    def __repr__(self) -> str:
        return f"({', '.join(map(repr, self.ins))}) -> ({', '.join(map(repr, self.outs))})"


SignatureFn = Callable[..., Sequence[Signature]]


@dataclass(frozen=True)
class KernelContext:
    """What a context kernel knows of this rank: the regions (boxes) of the logical inputs and
    outputs its local shards hold, and the chosen layouts. ``ctx=None`` means one device."""

    placement: Placement
    coord: tuple
    in_boxes: tuple
    out_boxes: tuple
    ins: tuple
    outs: tuple
    in_shapes: tuple = ()  # the logical shapes of the tensor inputs (e.g. a mean's count)


@dataclass
class Op:
    """A registered op. ``kernel(*locals, **attrs)`` runs on local shards (``ctx=`` is passed
    too when ``context`` is set: the rank's `KernelContext`)."""

    name: str
    kernel: Callable
    signatures: SignatureFn
    context: bool = False
    doc: str = ""
    same_dtype: bool = False  # torch refuses mixed input dtypes here (no type promotion)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


OPS: dict[str, Op] = {}


def register(name: str, kernel: Callable, signatures: SignatureFn, *, context: bool = False,
             doc: str = "", same_dtype: bool = False) -> Op:
    """Register op ``name``; a later registration of the same name replaces it.
    ``same_dtype``: torch's kernel requires every tensor input to have one dtype (matmul-like
    ops do not promote); the dispatch then refuses mixed dtypes with a `DtypeMismatchError`
    naming the inputs, as torch would (with torch's autocast casts applied first)."""
    op = Op(name, kernel, signatures, context, doc, same_dtype)
    OPS[name] = op
    return op


def get_op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise SignatureError(f"no op named {name!r} is registered") from None


_ATOMS = {int, float, bool, str, type(None), type(Ellipsis), torch.dtype}


def register_attr_type(cls: type) -> type:
    """Declare ``cls`` an attribute value type that is hashable as it is (immutable, with value
    equality), so `hashable` passes it through without looking inside. Returns ``cls``."""
    _ATOMS.add(cls)
    return cls


def hashable(value: Any) -> Any:
    """Attributes as a cache key (lists become tuples, dicts sorted items; values of the
    types of `register_attr_type` are kept as they are)."""
    t = type(value)
    if t in _ATOMS:   # the common case first: this runs on every dispatch
        return value
    if t is tuple and all(type(v) in _ATOMS for v in value):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, hashable(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        raise SignatureError("plain torch tensors cannot be op attributes; wrap them with sf.tensor")
    return value


# -- output metadata through torch's meta kernels ------------------------------------------------
def tensor_metas(args: tuple) -> list[TensorMeta]:
    return [a for a in args if isinstance(a, TensorMeta)]


def _meta_args(args: tuple, shapes: Sequence[tuple] | None = None) -> list:
    """``args`` with each `TensorMeta` replaced by a meta tensor (of ``shapes[i]`` if given)."""
    it = iter(shapes) if shapes is not None else None
    out = []
    for a in args:
        if isinstance(a, TensorMeta):
            shape = next(it) if it is not None else a.shape
            out.append(torch.empty(shape, dtype=a.dtype, device="meta"))
        else:
            out.append(a)
    return out


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _meta_kernel(op: Op, args: tuple, attrs: tuple, shapes=None,
                 ctx: "KernelContext | None" = None) -> tuple[TensorMeta, ...]:
    kwargs = dict(attrs)
    if op.context:
        kwargs["ctx"] = ctx  # None: the single-device (logical) case
    with torch.no_grad():
        res = op.kernel(*_meta_args(args, shapes), **kwargs)
    return tuple(TensorMeta(tuple(t.shape), t.dtype) for t in _as_tuple(res))


@memoize(1 << 14)
def out_metas(name: str, args: tuple, attrs: tuple) -> tuple[TensorMeta, ...]:
    """Logical output metadata of op ``name``: its kernel on meta tensors of the logical shapes.
    ``args`` holds a `TensorMeta` in each tensor slot and the constants elsewhere."""
    op = get_op(name)
    try:
        return _meta_kernel(op, args, attrs)
    except SbpError:
        raise  # the kernel's own check (e.g. an index out of range) says what is wrong
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise _invalid_inputs(name, args, attrs, exc) from None


def _invalid_inputs(name: str, args: tuple, attrs: tuple, exc: Exception) -> ShapeError:
    """The `ShapeError` saying torch's own objection to op ``name``'s logical inputs."""
    shapes = ", ".join(str(m.shape) for m in tensor_metas(args))
    return ShapeError(f"{name}: inputs of shapes {shapes} (attributes {dict(attrs)}) are not "
                      f"valid for the op: {str(exc).splitlines()[0]}")


def _signatures(op: Op, name: str, args: tuple, attrs: tuple) -> list:
    """Op ``name``'s 1-D signatures for ``args``. A generator that runs torch on the logical
    shapes (``expand``, ``reshape``) may be the first to meet invalid inputs (the meta kernel,
    run without a context, sees no logical target): torch's error becomes a `ShapeError`, as
    in `out_metas`."""
    try:
        return list(op.signatures(*args, **dict(attrs)))
    except SbpError:
        raise
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        raise _invalid_inputs(name, args, attrs, exc) from None


# -- choosing a signature -----------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """The N-D signature chosen: each input's required nd-sbp and each output's, and the bytes
    boxing the inputs to them moves."""

    ins: tuple
    outs: tuple
    out_metas: tuple
    nbytes: int


def _local_shapes_ok(op: Op, args, metas, outs_meta, ins_nd, outs_nd, placement, attrs) -> bool:
    """Whether, on every rank, the kernel maps local input shapes to the local output shapes
    (context kernels see the rank's `KernelContext`, as when they run for real)."""
    seen = set()
    for coord in placement.coords():
        in_boxes = tuple(shard_box(m.shape, placement.shape, nd, coord)
                         for m, nd in zip(metas, ins_nd))
        out_boxes = tuple(shard_box(m.shape, placement.shape, nd, coord)
                          for m, nd in zip(outs_meta, outs_nd))
        lin = tuple(tuple(n for _, n in b) for b in in_boxes)
        lout = tuple(tuple(n for _, n in b) for b in out_boxes)
        if (lin, lout) in seen:
            continue
        seen.add((lin, lout))
        ctx = None
        if op.context:
            ctx = KernelContext(placement, coord, in_boxes, out_boxes, ins_nd, outs_nd,
                                tuple(m.shape for m in metas))
        try:
            got = _meta_kernel(op, args, attrs, lin, ctx)
        except (RuntimeError, ValueError, IndexError, TypeError):
            return False
        if tuple(g.shape for g in got) != lout:
            return False
    return True


def _partial_penalty(meta: TensorMeta, nd: tuple, placement: Placement) -> int:
    """Bytes of reduce-scattering a partial-sum output: half of reducing it to B."""
    if not any(isinstance(s, Partial) and s.op == "sum" for s in nd):
        return 0
    reduced = tuple(B if isinstance(s, Partial) else s for s in nd)
    return plan_layouts(meta.shape, meta.dtype, Layout.parsed(placement, nd),
                        Layout.parsed(placement, reduced)).nbytes // 2


def choose(name: str, args: tuple, nd_sbps: tuple, placement: Placement, attrs: tuple,
           forced: tuple | None = None, grad: bool = False, pinned: tuple = ()) -> Choice:
    """The signature op ``name`` runs with (docs/internals.md, 'The op registry'). ``args``
    holds a `TensorMeta` in each tensor slot; ``nd_sbps`` their nd-sbps (with ``placement``,
    the inputs' layouts). ``forced``: input nd-sbps the caller insists on (None entries are
    free); `SignatureError` if no valid signature has them. ``grad``: some input requires
    grad, so signatures whose outputs carry no gradient (P(max), P(min)) are used only when
    nothing else is valid — a cheap max must not drop a gradient.
    ``pinned[i]``: tensor input i is a parameter; its layout is the user's statement of the
    strategy, so signatures that keep parameters in place come first (activations move).

    The order of preference: keeps gradients; moves fewest parameter bytes; fewest bytes of
    input boxing plus, for each partial-sum output, the reduce-scatter it will need later
    (so a free B→P does not hide a later all-reduce); fewest inputs changed; generator order.
    """
    op = get_op(name)
    metas = tensor_metas(args)
    outs_meta = out_metas(name, args, attrs)
    sigs_1d = _signatures(op, name, args, attrs)
    if not sigs_1d:
        raise SignatureError(f"{name}: no signature for inputs {[m.shape for m in metas]}")
    best, best_key, best_cost = None, None, 0
    for order, combo in enumerate(itertools.product(sigs_1d, repeat=placement.ndim)):
        ins_nd = tuple(tuple(sig.ins[i] for sig in combo) for i in range(len(metas)))
        outs_nd = tuple(tuple(sig.outs[j] for sig in combo) for j in range(len(outs_meta)))
        if forced is not None and any(f is not None and f != nd for f, nd in zip(forced, ins_nd)):
            continue
        cost, param_cost, changed = 0, 0, 0
        for i, (m, have, want) in enumerate(zip(metas, nd_sbps, ins_nd)):
            if have != want:
                changed += 1
                moved = plan_layouts(m.shape, m.dtype, Layout.parsed(placement, have),
                                     Layout.parsed(placement, want)).nbytes
                if i < len(pinned) and pinned[i]:
                    param_cost += moved
                cost += moved
        later = sum(_partial_penalty(m, nd, placement) for m, nd in zip(outs_meta, outs_nd))
        key = (int(grad and detaches(outs_nd)), param_cost, cost + later, changed, order)
        if best_key is not None and key >= best_key:
            continue
        if not _local_shapes_ok(op, args, metas, outs_meta, ins_nd, outs_nd, placement, attrs):
            continue
        best, best_key, best_cost = (ins_nd, outs_nd), key, cost
    if best is None:
        shown = ", ".join(f"{m.shape} {format_nd_sbp(l)}" for m, l in zip(metas, nd_sbps))
        want = "" if forced is None else \
            f" with inputs forced to {[format_nd_sbp(f) for f in forced if f is not None]}"
        raise SignatureError(f"{name}: no valid signature{want} for inputs {shown} on "
                             f"{placement}; its 1-D signatures here: {sigs_1d}")
    return Choice(best[0], best[1], outs_meta, best_cost)


def detaches(outs_nd: tuple) -> bool:
    """Outputs laid out as P(max)/P(min) carry no gradient (docs/design.md)."""
    return any(isinstance(s, Partial) and s.op != "sum" for nd in outs_nd for s in nd)
