"""Weights tied across pipeline stages (GPT-2's token embedding and LM head on the first and last
stage), the way Megatron-LM runs them: every stage that uses the weight holds a copy, and the
copies' gradients are summed once a step, before the update.

In SBP terms the copies are one `Parameter` on the *tie placement*: the users' stage meshes
stacked along a new outer mesh dim, laid out ``B`` along it (``(B, *stage nd-sbp)``). Each stage's
ranks hold their stage's shard, so the weight is one parameter to the optimizer, the checkpoint
and ``model.parameters()``; its gradient is ``P`` along the new dim, and the optimizer's gradient
boxing ``P -> B`` is the all-reduce of the copies' gradients (Megatron's embedding group), in
eager and graph mode alike. A user module reads a `StageView` (the same local shard, on its
stage's placement) swapped in by forward hooks. See docs/runtime.md, 'Pipeline stages'.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..boxing import empty_local
from ..comm import rank as _rank
from ..errors import ParallelizeError
from ..layouts import Layout
from ..param_state import reduce_at_step
from ..nn.modules import Module, Parameter, RemovableHandle
from ..placement import Placement
from ..sbp import B, format_nd_sbp
from ..tensor import GlobalTensor

__all__ = ["StageView", "tie_placement", "install_views"]


class StageView(GlobalTensor):
    """The part of a tied parameter one stage reads: its placement and nd-sbp are the stage's
    (the tie placement's row of that stage, the sbp without the outer ``B``); its shard is the
    parameter's current shard on the stage's ranks (the same leaf tensor, so gradients
    accumulate into the parameter) and an empty tensor elsewhere. Made once and kept, so a
    graph's replay re-reads the parameter's shard through it."""

    __slots__ = ("_param", "_mine", "_empty")

    def __init__(self, param: Parameter, placement: Placement, sbp: tuple) -> None:
        # fields set by hand: GlobalTensor.__init__ would report the view to a graph's tracer
        # as a tensor made outside the ops (it is not: it reads the parameter)
        self._param, self._mine, self._empty = param, _rank() in placement, None
        self._shape, self._placement, self._sbp = tuple(param.shape), placement, tuple(sbp)
        self._key = self._boxes = None

    def _get_local(self) -> torch.Tensor:
        if self._mine:
            return self._param.shard
        e, p = self._empty, self._param.shard
        if e is None or e.dtype != p.dtype or e.device != p.device:
            e = self._empty = empty_local(p.dtype, p.device)
        return e

    def _set_local(self, value: torch.Tensor) -> None:
        # (only a tracer's relabelling of a shard it saw twice; the parameter keeps its own)
        self._mine, self._empty = False, value

    _local = property(_get_local, _set_local)


def tie_placement(name: str, stage_pls: Sequence[Placement], layouts: Sequence[tuple],
                  who: str) -> Layout:
    """The `Layout` (tie placement, nd-sbp) of a parameter whose users' stages are on
    ``stage_pls`` (in stage order) with the nd-sbps ``layouts``: the meshes stacked along a new
    outer dim, ``B`` there. `ParallelizeError` when the stages' meshes differ in shape or device
    type, or the layouts differ (one weight has one layout; Megatron's tie needs the same too)."""
    first, nd = stage_pls[0], tuple(layouts[0])
    for pl, lay in zip(stage_pls[1:], layouts[1:]):
        if tuple(pl.shape) != tuple(first.shape) or pl.device_type != first.device_type:
            raise ParallelizeError(
                f"{who}: {name} is tied across stages on {first} and {pl}, whose meshes "
                f"differ ({first.device_type} {tuple(first.shape)} vs {pl.device_type} "
                f"{tuple(pl.shape)}); each stage holds a copy laid out alike, so give the "
                f"stages that use it meshes of one shape, or untie the weight")
        if tuple(lay) != nd:
            raise ParallelizeError(
                f"{who}: {name} is tied across stages on {first} (sbp {format_nd_sbp(nd)}) "
                f"and {pl} (sbp {format_nd_sbp(lay)}); the copies must be laid out alike: "
                f"give the weight's names one nd-sbp in both stages' rules")
    ranks = [pl.ranks for pl in stage_pls]
    return Layout.parsed(Placement(first.device_type, ranks), (B,) + nd)


def install_views(param: Parameter, users: Sequence[tuple[Module, str, Placement]]) \
        -> list[RemovableHandle]:
    """Swap ``param`` for its `StageView` on each user's stage while that user's forward runs:
    ``users`` are (module, attribute name, stage placement). ``param`` must be on the tie
    placement (`tie_placement`), whose rows are the stage placements. Returns the hooks."""
    _no_overlap(param)
    views: dict = {}
    handles = []
    for m, key, pl in users:
        if id(pl) not in views:
            views[id(pl)] = StageView(param, pl, param.sbp[1:])
        view = views[id(pl)]

        def enter(mod, _args, key=key, view=view):
            if mod._parameters.get(key) is param:
                mod._parameters[key] = view

        def leave(mod, _args, _out, key=key, view=view):
            if mod._parameters.get(key) is view:
                mod._parameters[key] = param
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave, always_call=True))
    return handles


def _no_overlap(param: Parameter) -> None:
    """Keep ``param``'s gradient all-reduce out of the ones started during backward
    (`sbpflow.gradsync.GradSync`): the last stage's backward would start it while the first
    stage still waits for that backward's gradient, and a collective that does not return
    until every member joins (the threads backend's) would never end. The optimizer's step
    all-reduces it instead."""
    reduce_at_step(param)
