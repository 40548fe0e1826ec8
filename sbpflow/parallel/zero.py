"""``sf.parallel.zero``: ZeRO stages 1-3 on a laid-out model, the user face (docs/zero.md).
`shard` (and ``sf.parallel.apply(..., zero=)``) store, along each parameter's data-parallel
dims, its optimizer state (1), gradient (2) and the parameter itself (3) split; the stages'
layouts, units, gathers and reduce-scatters live in `sbpflow.zero`, whose docstring says how
they work. `settle`, `stored_layout`, `check_stage`, `check_min_size` and `STAGES` are its."""

from __future__ import annotations

from ..errors import OptimizerStateError
from ..nn.modules import Module
from ..param_state import first_stepped
from ..sbp import format_nd_sbp
from ..zero import release as _release
from ..zero import units as _units
from ..zero.layout import STAGES, check_min_size, check_stage, stored_layout
from ..zero.pending import settle

__all__ = ["shard", "stored_layout", "check_stage", "check_min_size", "settle", "STAGES"]


def shard(model: Module, stage: int, min_size: int = 0, *, compute: dict | None = None,
          units: list | None = None, only: set | None = None) -> list:
    """ZeRO ``stage`` (0-3) on ``model``, in place (the parameter objects stay the same); see
    `sbpflow.zero.units.shard_` (``compute``, ``units``, ``only``). Returns the names of the
    parameters it shards. Every rank calls it, before building the optimizer (or before its
    first step: state already in it, a loaded one, is moved to the new update layout at that
    step, `sbpflow.optim.state_layout.conform`); after an optimizer's step over one of the
    parameters it raises `OptimizerStateError` (it would change nothing the optimizer does).
    ``min_size``: an int >= 0 (`check_min_size`). Communicates: stages 2 and 3 box each
    sharded parameter to its stored layout (a local slice of a ``B`` one)."""
    min_size = check_min_size(min_size, "sf.parallel.zero.shard")
    if check_stage(stage, "sf.parallel.zero.shard"):
        _refuse_stepped(model, stage, only)
    return _units.shard_(model, stage, min_size, compute=compute, on_gather=_release.on_gather,
                         units=units, only=only)


def _refuse_stepped(model: Module, stage: int, only: set | None) -> None:
    """Raise if an optimizer has stepped one of ``model``'s parameters (the ones of ``only``):
    its gradient sync and update are set up at the first step, so the stage would be ignored."""
    named = [(n, p) for n, p in model.named_parameters() if only is None or id(p) in only]
    p = first_stepped([p for _, p in named])
    if p is None:
        return
    name = next(n for n, q in named if q is p)
    raise OptimizerStateError(
        f"sf.parallel.zero.shard(stage={stage}): parameter {name!r} (shape {tuple(p.shape)}, "
        f"placement {p.placement}, sbp {format_nd_sbp(p.sbp)}) was already updated by an "
        f"optimizer's step, which set up its gradient sync and update layout: the stage would "
        f"have no effect. Call sf.parallel.zero.shard before the optimizer's first step "
        f"(best, before building the optimizer)")
