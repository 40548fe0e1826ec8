"""GlobalTensor: a logical tensor laid out over a placement by an nd-sbp.

Each rank holds its local shard (docs/design.md: the local-shard rule); a rank outside
the placement holds an empty tensor. Autograd runs on the local shards; boxing steps are
autograd Functions with dual backward, so ``x.grad`` of a tensor laid out as ``s`` is laid out
as ``dual(s)``.

Here: the class (metadata, layout, autograd, in-place bookkeeping, display), the remaking and
writing through of its views, and the region maker `_create`. Its operators and torch-like
methods are in tensor/methods.py (attached by `_set_methods`), the dispatch `apply_op` in
tensor/dispatch.py (bound here late: `_bind_dispatch`), plain torch tensors lifted in
tensor/mixing.py; what a view remembers in tensor/views.py, creation ops in tensor/creation.py.
"""

from __future__ import annotations

import math
import numbers
from operator import attrgetter
from typing import Sequence

import torch

from .. import comm as _comm
from ..boxing import empty_local, plan_layouts, run_plan
from ..errors import GraphError, PlacementError, SbpError, SbpParseError, ShapeError
from ..errors import UnsupportedTorchFunction
from ..layouts import Layout
from ..placement import Placement
from ..sbp import (B, SbpLike, check_axes, dual_nd, format_nd_sbp, holds_value, parse_nd_sbp,
                   shard_box)
from .dispatch_records import _describe
from .hooks import _torch_dispatch, _tracing
from .views import _stale, _take, _version, _viewed

__all__ = ["GlobalTensor", "retains_grads"]


# -- the dispatch, bound late --------------------------------------------------------------------
# The class and its views run ops through `apply_op` (tensor/dispatch.py). The dispatch makes
# global tensors, so it imports this module, which cannot import it back (no two modules import
# each other: tests/test_layers.py); tensor/__init__.py binds it here once, at import
# (`_bind_dispatch`). A module global: a call costs what a call of an imported name costs.
apply_op = None


def _bind_dispatch(run) -> None:
    """Make ``run`` (tensor/dispatch.py's `apply_op`) the dispatch this module's code calls."""
    global apply_op
    apply_op = run


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
        self._shape = tuple(map(int, shape))
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
        """The logical shape (a ``torch.Size``), the same on every rank."""
        return torch.Size(self._shape)

    def size(self, dim: int | None = None):
        """``shape``, or its entry ``dim``, as torch's."""
        return self.shape if dim is None else self._shape[dim]

    @property
    def ndim(self) -> int:
        """The number of logical axes."""
        return len(self._shape)

    def dim(self) -> int:
        """The number of logical axes, as torch's."""
        return len(self._shape)

    def numel(self) -> int:
        """Elements of the logical tensor (not of the shard)."""
        return math.prod(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the tensor (every shard has it)."""
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        """This rank's device (where its shard is)."""
        return self._local.device

    # read-only, and as cheap as reading the slot (a getter in C): the other modules read a
    # tensor's layout and stored shard through these, never through the private slots
    placement = property(attrgetter("_placement"), doc="The placement (an `sf.placement`).")
    sbp = property(attrgetter("_sbp"), doc="The nd-sbp: a tuple, one sbp per mesh dim.")

    @property
    def global_layout(self) -> Layout:
        """The layout, ``sf.Layout(placement, sbp)`` (equal to that pair; ``.dual()`` is the
        gradient's). Not ``layout``: that is torch's memory layout (``torch.strided``)."""
        return Layout.parsed(self._placement, self._sbp)
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
        """This rank's shard, ``local`` (DTensor's name)."""
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
        plan = plan_layouts(self._shape, self.dtype, self.global_layout,
                            Layout.parsed(dst_pl, dst_sbp))
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
        """Whether autograd records ops on it (its shard's flag)."""
        if self._view is not None:
            _fresh(self)
        return self._local.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        """``p.requires_grad = False``, as torch: `requires_grad_` (which a subclass, such as
        a parameter, may extend)."""
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad: bool = True) -> "GlobalTensor":
        """As torch's: set ``requires_grad`` (on every rank alike); returns the tensor."""
        self._local.requires_grad_(requires_grad)
        return self

    @property
    def is_leaf(self) -> bool:
        """As torch's: whether no recorded op made it (its shard's flag)."""
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
