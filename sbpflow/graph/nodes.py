"""The records of a traced graph: one named tuple a kind of task, each with ``run(vals, env)``.

Values live in slots of a per-micro-batch list ``vals`` (local shards). An `OpNode` calls its op's
torch kernel with the signature fixed at trace time; a `BoxNode` runs a boxing plan; a
`DetachNode` detaches; a `ThunkNode` recomputes a value that must change on every replay (a
random draw); a `BackwardNode` is the ``loss.backward()`` of ``build`` (run by the backward actor,
not here). ``mode`` is the grad mode and autocast dtype the task was traced under.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..boxing import apply_step
from ..placement import Placement
from ..utils import rebuild_sequence

__all__ = ["Env", "Mode", "OpNode", "BoxNode", "DetachNode", "ThunkNode", "GuardNode", "SourceNode",
           "AssignNode",
           "source_values", "source_like",
           "BackwardNode", "run_nodes"]


class Env(NamedTuple):
    """What a replay needs besides the slots: the rank's communicator, the device type, the
    position in the default seed stream of the micro-batch's first random draw, and for means
    over micro-batches weighted by rows (`sbpflow.nn.graph_count_mean`) the micro-batch's weight,
    the call's shared record of them and the ids of the activations the stage received."""

    comm: Any
    device_type: str
    draw_base: int = 0
    weight: float = 1.0
    means: dict | None = None
    received: frozenset = frozenset()


class Mode(NamedTuple):
    """What torch's thread-local state was when a task was traced (runtime threads start with
    torch's defaults, so replay sets it)."""

    grad: bool
    autocast: torch.dtype | None  # the autocast dtype of the placement's device type, if on

    @classmethod
    def now(cls, device_type: str) -> "Mode":
        on = torch.is_autocast_enabled(device_type)
        return cls(torch.is_grad_enabled(), torch.get_autocast_dtype(device_type) if on else None)

    def enter(self, device_type: str) -> None:
        torch.set_grad_enabled(self.grad)
        torch.set_autocast_enabled(device_type, self.autocast is not None)
        if self.autocast is not None:
            torch.set_autocast_dtype(device_type, self.autocast)


class OpNode(NamedTuple):
    """``outs = kernel(*args)`` with the tensor arguments read from ``slots`` ((position, slot)
    pairs) and the constants kept in ``args``; ``ins``/``outs_sbp`` are the signature chosen."""

    name: str
    kernel: Callable | None      # None: an op of a placement this rank is not in
    args: tuple
    slots: tuple
    attrs: dict
    outs: tuple
    multi: bool
    detach: bool
    placement: Placement
    mode: Mode
    ins: tuple                   # nd-sbp of each tensor input (after boxing)
    outs_sbp: tuple
    translate: Callable | None = None   # the `errors_as` rule it was traced under

    def run(self, vals: list, env: Any) -> None:
        a = list(self.args)
        for pos, s in self.slots:
            a[pos] = vals[s]
        if self.translate is None:
            r = self.kernel(*a, **self.attrs)
        else:
            try:
                r = self.kernel(*a, **self.attrs)
            except Exception as exc:  # noqa: BLE001 - the rule decides, as in eager
                new = self.translate(exc)
                if new is None:
                    raise
                raise new from None
        if self.multi:
            for o, t in zip(self.outs, r):
                vals[o] = t.detach() if self.detach else t
        else:
            vals[self.outs[0]] = r.detach() if self.detach else r


class BoxNode(NamedTuple):
    """``vals[out]`` = the boxing ``steps`` run on ``vals[src]`` (steps that change placement
    are cut out by the lowering: a stage-to-stage transfer is an actor of its own)."""

    steps: tuple
    src: int
    out: int
    placement: Placement         # the destination's
    mode: Mode

    def run(self, vals: list, env: Any) -> None:
        x = vals[self.src]
        for step in self.steps:
            x = apply_step(step, x, env.comm)
        vals[self.out] = x

    @property
    def name(self) -> str:
        return "box"


class DetachNode(NamedTuple):
    src: int
    out: int
    placement: Placement
    mode: Mode

    def run(self, vals: list, env: Any) -> None:
        vals[self.out] = vals[self.src].detach()

    @property
    def name(self) -> str:
        return "detach"


class ThunkNode(NamedTuple):
    """``vals[out] = make()``: a value drawn again at every replay (``make`` returns a shard).
    It is draw ``index`` of the tape: it takes that place in the default seed stream, so every
    rank's stream agrees with eager's whichever stage runs the draw."""

    make: Callable[[], torch.Tensor]
    out: int
    placement: Placement
    mode: Mode
    index: int

    def run(self, vals: list, env: Any) -> None:
        env.comm.per_rank.seed_counter = env.draw_base + self.index
        vals[self.out] = self.make()

    @property
    def name(self) -> str:
        return "draw"


class SourceNode(NamedTuple):
    """The ``index``-th data source ``build`` reads (``sf.tensor.source``): ``load()`` gives the
    next whole batch, whose values ``metas`` describe; micro-batch m's rows go to slots ``outs``.
    Run by the stage's loading actor, once a call, not by `run_nodes`."""

    load: Callable[[], Any]
    index: int
    outs: tuple
    metas: tuple
    placement: Placement
    mode: Mode

    @property
    def name(self) -> str:
        return "load"


def source_values(batch: Any) -> tuple:
    """A data source's batch as its values in order: one global tensor, or those of a tuple,
    list, namedtuple or dict of them (`source_like` rebuilds that structure)."""
    if isinstance(batch, dict):
        return tuple(batch.values())
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def source_like(batch: Any, values: Sequence) -> Any:
    """``values`` in the structure of ``batch`` (a data source's batch, `source_values`)."""
    if isinstance(batch, dict):
        return dict(zip(batch, values))
    return rebuild_sequence(batch, values) if isinstance(batch, (tuple, list)) else values[0]


class GuardNode(NamedTuple):
    """``check(vals[src])``: a check of values (an index range) that must run on each call."""

    check: Callable[[torch.Tensor], None]
    src: int
    placement: Placement
    mode: Mode

    def run(self, vals: list, env: Any) -> None:
        self.check(vals[self.src])

    @property
    def name(self) -> str:
        return "check"


class AssignNode(NamedTuple):
    """``vals[dst].copy_(vals[src])``: an in-place op of ``build`` on a tensor that keeps its
    shard (a buffer, a parameter under ``no_grad``: ``+=``, ``copy_``, ``x[i] = v``; see
    `GlobalTensor._assign_`). Always run: later tasks and later calls read what it wrote."""

    src: int
    dst: int
    placement: Placement
    mode: Mode
    fresh: bool = False   # ``dst`` is a constant build made: write a copy of it, which the
    # rest of this replay reads, and leave the constant as made for the next one

    keep = True   # (a class attribute, not a field: `live_nodes` keeps it whatever reads it)

    @property
    def slots_read(self) -> tuple:
        return (self.src, self.dst)

    def run(self, vals: list, env: Any) -> None:
        if self.fresh:
            vals[self.dst] = vals[self.dst].clone()
        vals[self.dst].copy_(vals[self.src])   # (in the grad mode traced, as eager's copy)

    @property
    def name(self) -> str:
        return "assign"


class BackwardNode(NamedTuple):
    """``vals[loss].backward(seed)``; ``seed`` a slot or (``seed_slot`` None) the constant
    ``seed_value`` (the logical 1 in layout dual(sbp))."""

    loss: int
    seed_slot: int | None
    seed_value: torch.Tensor | None
    placement: Placement
    mode: Mode

    def seed(self, vals: list) -> torch.Tensor:
        return self.seed_value if self.seed_slot is None else vals[self.seed_slot]

    @property
    def name(self) -> str:
        return "backward"


def run_nodes(nodes: list, vals: list, env: Any, frees: list | None = None) -> None:
    """Run ``nodes`` in order on ``vals``, each under the torch mode it was traced in (the
    thread's grad mode and autocast state are restored after); ``frees[i]``: slots dropped
    after node i."""
    dev = env.device_type
    saved = Mode.now(dev)
    mode = saved
    try:
        for i, n in enumerate(nodes):
            if n.mode != mode:
                mode = n.mode
                mode.enter(dev)
            n.run(vals, env)
            if frees is not None:
                for s in frees[i]:
                    vals[s] = None
    finally:
        if mode != saved:
            saved.enter(dev)
