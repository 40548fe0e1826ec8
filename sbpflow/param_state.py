"""A parameter's framework state, one typed record (`ParamState`) per parameter object, kept
beside it by identity (the entry goes with the parameter): the layout its optimizer state and
update live in when not its own (ZeRO stage 1), the whole copy its shard is completed into
after an update (ZeRO 1 and 2) and that copy's last filled version, whether its gradient is
reduced at the step only (a weight tied across pipeline stages), who replaced it by a new
object (an optimizer holding it then refuses to step) and whether an optimizer has stepped it
(`sf.parallel.zero.shard` then refuses). The accessors below are the only writers; a reader
of a parameter without a record sees the defaults (its own layout, nothing to fill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm as _comm
from .tensor import GlobalTensor
from .utils import IdentityMap

__all__ = ["ParamState", "state_of", "set_update_layout", "update_layout", "has_update_layouts",
           "set_backfill", "backfill", "has_backfills", "mark_stale", "mark_filled",
           "take_stale", "reduce_at_step", "reduced_at_step", "mark_replaced", "replaced_by",
           "replaced_version", "mark_stepped", "first_stepped"]


@dataclass(slots=True)
class ParamState:
    """What the framework keeps about one parameter (None / False: as its own layout says)."""

    update_layout: tuple | None = None   # nd-sbp of its optimizer state, reduced gradient, update
    backfill: tuple | None = None        # (whole local or None: its own, compute layout)
    filled_version: int | None = None    # the whole copy's version when last all-gathered
    reduce_at_step: bool = False         # no all-reduce started during backward
    replaced_by: tuple | None = None     # (its name, who replaced it by a new object)
    stepped: bool = False                # an optimizer's step has updated it


_STATES = IdentityMap()
# fast-path guards: whether any parameter was ever given an update layout / a backfill (False:
# `update_layout` is the parameter's own and `backfill` None for every one, without a lookup)
_EVER = {"update_layout": False, "backfill": False, "stepped": False}
_REPLACED_VERSION = [0]


def state_of(p: GlobalTensor) -> ParamState | None:
    """``p``'s record, or None when it has none (every field at its default)."""
    return _STATES.get(p) if _STATES else None


def _record(p: GlobalTensor) -> ParamState:
    st = _STATES.get(p)
    if st is None:
        st = _STATES[p] = ParamState()
    return st


def set_update_layout(p: GlobalTensor, nd_sbp: tuple | None) -> None:
    """Keep ``p``'s optimizer state in ``nd_sbp`` and update ``p`` there: its gradient is boxed
    to ``nd_sbp`` (a reduce-scatter), the shard of ``p`` inside it updated, and the result
    gathered back into ``p``'s own layout. Each shard of ``nd_sbp`` must lie inside ``p``'s
    shard on the same rank (`sbpflow.zero.layout.stored_layout` gives such a layout).
    None, or ``p``'s own layout: the default again."""
    if nd_sbp is None or tuple(nd_sbp) == tuple(p.sbp):
        st = state_of(p)
        if st is not None:
            st.update_layout = None
    else:
        _record(p).update_layout = tuple(nd_sbp)
        _EVER["update_layout"] = True


def update_layout(p: GlobalTensor) -> tuple:
    """The nd-sbp ``p``'s optimizer state and update live in (`set_update_layout`; by default
    ``p``'s own)."""
    if not _EVER["update_layout"]:
        return p.sbp
    st = _STATES.get(p)
    return p.sbp if st is None or st.update_layout is None else st.update_layout


def has_update_layouts() -> bool:
    """Whether a parameter may be updated in a layout of its own (False: `update_layout` is
    the parameter's layout for every one)."""
    return _EVER["update_layout"]


def set_backfill(p: GlobalTensor, whole: torch.Tensor | None, compute: tuple) -> None:
    """After an update of ``p`` (laid out split), all-gather into ``whole`` (``p``'s shard is a
    view of it; None: ``p``'s own local, whose update layout is split), laid out ``compute``."""
    _record(p).backfill = (whole, tuple(compute))
    _EVER["backfill"] = True


def backfill(p: GlobalTensor) -> tuple | None:
    """(whole local, compute layout, split layout) to all-gather into after ``p``'s update."""
    st = _STATES.get(p) if _EVER["backfill"] else None
    if st is None or st.backfill is None:
        return None
    whole, compute = st.backfill
    if whole is None:
        return p.local.detach(), tuple(p.sbp), update_layout(p)
    return whole, compute, tuple(p.sbp)


def has_backfills() -> bool:
    """Whether a parameter may have an all-gather after its update (False: `backfill` is None
    for every one)."""
    return _EVER["backfill"]


def _whole(p: GlobalTensor) -> torch.Tensor | None:
    """``p``'s whole copy (`set_backfill`), or None."""
    st = _STATES.get(p) if _EVER["backfill"] else None
    return None if st is None or st.backfill is None else st.backfill[0]


def mark_stale(p: GlobalTensor) -> None:
    """``p``'s shard was written (a load): its whole copy, if it has one, is gathered again
    before its next use (`take_stale`). Any write that bumps the shard's version is seen
    without it (`mark_filled`)."""
    if _whole(p) is not None:
        _comm.current().per_rank.stale_wholes[p] = True


def mark_filled(p: GlobalTensor) -> None:
    """``p``'s whole copy (`set_backfill`) was just filled: every member's part is current.
    Called after each all-gather into it (`sbpflow.zero.pending.settle` does it for the
    optimizer's). The shard is a view of the whole copy and torch's views share one version
    counter, so every in-place write to the shard since shows as another version."""
    whole = _whole(p)
    if whole is not None:
        _STATES[p].filled_version = whole._version


def take_stale(params) -> list:
    """Those of ``params`` whose whole copy must be gathered again before its use, unmarked:
    marked by `mark_stale`, or written since `mark_filled`. Every member of a group writes its
    shard alike (an in-place op on a parameter is a logical op), so they agree on which, as
    the gather needs. The caller waits for their gathers in flight first."""
    stale = _comm.current().per_rank.stale_wholes
    out = []
    for p in params:
        marked = stale is not None and stale.pop(p, None) is not None
        whole = _whole(p)
        if whole is not None and (marked or _STATES[p].filled_version != whole._version):
            out.append(p)
    return out


def reduce_at_step(p: GlobalTensor) -> None:
    """Never start ``p``'s gradient all-reduce during backward (`sbpflow.gradsync.GradSync`):
    the optimizer's step boxes it. For a parameter whose users' backward passes run at
    different times on different ranks (a weight tied across pipeline stages): a collective
    started by one stage's backward would wait for a gradient another stage has not made."""
    _record(p).reduce_at_step = True


def reduced_at_step(p: GlobalTensor) -> bool:
    """Whether ``p``'s gradient is reduced by the step only: `reduce_at_step`, or an update
    layout of its own (`set_update_layout`: the step reduce-scatters it)."""
    st = state_of(p)
    return st is not None and (st.reduce_at_step or st.update_layout is not None)


def mark_replaced(p: GlobalTensor, name: str, who: str) -> None:
    """Record that parameter ``p`` (``name`` in its model) was replaced by a new object by
    ``who`` (e.g. ``"sf.parallel.apply"``): an optimizer's step over ``p`` then raises
    instead of updating a tensor nothing uses. `replaced_version` counts the marks."""
    _record(p).replaced_by = (name, who)
    _REPLACED_VERSION[0] += 1


def replaced_by(p: GlobalTensor) -> tuple | None:
    """(name, who) if ``p`` was replaced (`mark_replaced`), else None."""
    st = state_of(p)
    return None if st is None else st.replaced_by


def replaced_version() -> int:
    """How many parameters were ever marked replaced (0: none, no lookup needed)."""
    return _REPLACED_VERSION[0]


def mark_stepped(params) -> None:
    """``params`` were updated by an optimizer's step (its first: `first_stepped`)."""
    for p in params:
        _record(p).stepped = True
    _EVER["stepped"] = True


def first_stepped(params) -> GlobalTensor | None:
    """The first of ``params`` an optimizer has stepped (`mark_stepped`), or None."""
    if not _EVER["stepped"]:
        return None
    return next((p for p in params if (st := _STATES.get(p)) is not None and st.stepped), None)
