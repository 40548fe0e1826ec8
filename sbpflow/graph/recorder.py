"""Tracing ``build`` into a `Tape`: the ops, boxing steps and backward of one micro-batch.

`Recorder` is what `sbpflow.tensor` calls while ``build`` runs eagerly once (on real shards: every
op also runs, so shapes and signatures are the eager ones). Values are known by their local shard
(``id``, kept alive while tracing). A tensor read by a task but made by no recorded task is an
*external*: a parameter, a buffer, or a constant created in ``build`` (its shard is re-read at
each replay). A value computed outside sbpflow's ops (``from_local`` on a torch result, a shard
edited in torch) cannot be replayed: reading it raises `GraphError`. ``loss.backward()`` is
recorded, not run. See docs/runtime.md, 'Graph mode'.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..errors import GraphError
from ..placement import Placement
from ..sbp import format_nd_sbp
from ..tensor import GlobalTensor, error_rule
from ..utils import rebuild_sequence
from .microbatch import split_inputs
from .nodes import (AssignNode, BackwardNode, BoxNode, DetachNode, GuardNode, Mode, OpNode,
                    SourceNode, ThunkNode, source_like, source_values)

__all__ = ["Meta", "Tape", "Recorder", "OutSlot", "OutConst", "out_slots"]


class OutSlot(NamedTuple):
    """A tensor the graph returns: the value of ``slot``."""

    slot: int


class OutConst(NamedTuple):
    """A value the graph returns that is not a tensor (returned as traced)."""

    value: Any


def out_slots(template: Any) -> list[int]:
    """The slots of the tensors in an output template, in order."""
    if isinstance(template, OutSlot):
        return [template.slot]
    if isinstance(template, OutConst):
        return []
    items = template.values() if isinstance(template, dict) else template
    return [s for t in items for s in out_slots(t)]


class Meta(NamedTuple):
    """A value's logical metadata: what wraps its shard back into a `GlobalTensor`."""

    shape: tuple
    dtype: torch.dtype
    placement: Placement
    sbp: tuple
    grad: bool      # required grad when traced

    def describe(self) -> str:
        return f"{self.shape} {format_nd_sbp(self.sbp)}"


class Tape(NamedTuple):
    """One micro-batch's program on one rank: ``nodes`` in order, ``inputs`` (slot of each
    build input, None for a non-tensor), ``externals`` ((slot, tensor) re-read at each replay),
    ``backwards`` (the `BackwardNode`s), ``outputs`` (the returned structure, tensors as
    `OutSlot`, other values as `OutConst`), ``metas`` (slot -> `Meta`), ``nslots``,
    ``draws``, ``outs``."""

    nodes: list
    inputs: tuple
    externals: list
    backwards: list
    outputs: Any
    metas: dict
    nslots: int
    draws: int      # random draws (`ThunkNode`s) a micro-batch makes
    outs: tuple     # the slots of the tensors in ``outputs``, in order (`out_slots`)

    def new_vals(self, input_locals: list) -> list:
        """A fresh slot list holding the inputs' and the externals' shards."""
        vals = [None] * self.nslots
        for slot, local in zip(self.inputs, input_locals):
            if slot is not None:
                vals[slot] = local
        for slot, t in self.externals:
            vals[slot] = t.shard
        return vals

    def placements(self) -> list[Placement]:
        """The distinct placements of the values, in order of first appearance."""
        seen: list[Placement] = []
        for m in self.metas.values():
            if m.placement not in seen:
                seen.append(m.placement)
        return seen


class Recorder:
    """Collects the tasks ``build`` runs on this rank (the hooks of `sbpflow.tensor`)."""

    def __init__(self, micro_batch: int = 0, micro_batches: int = 1,
                 batches: list | None = None, weighs_means: bool = False) -> None:
        # the micro-batch traced, of how many; the batches data sources gave this compile
        # (shared by the traces of its micro-batch shapes, so each batch is loaded once)
        self.micro_batch, self.micro_batches = micro_batch, micro_batches
        # whether a mean loss of a micro-batch counts by its share of the batch's rows
        # (several micro-batches, loss reduction "mean"): read by means over counted targets
        self.weighs_means = weighs_means
        self.batches = [] if batches is None else batches
        self.sources = 0
        self.draws = 0
        self.nodes: list = []
        self.slot_of: dict[int, int] = {}   # id(local shard) -> slot
        self.keep: list = []                # the shards whose ids are in use
        self.untraced: set[int] = set()     # shards made outside the recorded tasks
        self.externals: list = []
        self.external_slots: set[int] = set()   # externals' and inputs' slots
        self.backwards: list = []
        self.metas: dict[int, Meta] = {}
        self.inputs: list = []
        self.modules: dict[int, Any] = {}   # id -> a module whose forward ran
        self.written: list = []   # (tensor, its shard's values before build wrote them)
        self.constants: set[int] = set()   # ids of the shards of constants build made

    # -- slots -------------------------------------------------------------------------------
    def _new(self, t: GlobalTensor) -> int:
        slot = len(self.metas)
        local = t.shard
        if id(local) in self.slot_of:  # a task handed back a shard it read (a boxing that
            # passes it through on a rank outside its placements, a no-op kernel): give the
            # new value its own object, or later reads of the old one would find the new slot
            local = t._local = local.view_as(local)
        self.slot_of[id(local)] = slot
        self.keep.append(local)
        self.untraced.discard(id(local))
        self.metas[slot] = Meta(t._shape, local.dtype, t.placement, t.sbp, local.requires_grad)
        return slot

    def read(self, t: GlobalTensor, by: str) -> int:
        """The slot of ``t``'s shard, read by task ``by`` (a new external when no task made
        it)."""
        local = t.shard
        slot = self.slot_of.get(id(local))
        if slot is not None:
            return slot
        if id(local) in self.untraced or local.grad_fn is not None:
            raise GraphError(
                f"graph: {by} reads a tensor of shape {t._shape} on {t.placement} with sbp "
                f"{format_nd_sbp(t.sbp)} that build computed outside sbpflow's ops (from_local "
                f"on a torch result, a shard changed in torch, activation checkpointing, a "
                f"gradient read in build); a graph cannot replay it. Compute it with sbpflow "
                f"ops, or pass it to the graph as an input")
        slot = self._new(t)
        self.externals.append((slot, t))
        self.external_slots.add(slot)
        return slot

    def add_input(self, t: Any) -> None:
        slot = self._new(t) if isinstance(t, GlobalTensor) else None
        self.inputs.append(slot)
        if slot is not None:
            self.external_slots.add(slot)   # (as an external: its writes are undone after)

    # -- the hooks of sbpflow.tensor ------------------------------------------------------------
    def made(self, local: torch.Tensor) -> None:
        """A `GlobalTensor` was built around ``local`` outside the recorded tasks."""
        self.untraced.add(id(local))
        self.keep.append(local)

    def constant(self, t: GlobalTensor) -> None:
        self.untraced.discard(id(t.shard))
        self.constants.add(id(t.shard))
        self.keep.append(t.shard)   # (its id stays its own while tracing)

    def op(self, entry, args: tuple, boxed: list, local_args, attrs: dict, out, pl) -> None:
        name = entry.op.name
        it = iter(boxed)
        consts, slots = [], []
        for pos, a in enumerate(args):
            if isinstance(a, GlobalTensor):
                slots.append((pos, self.read(next(it), f"op {name}")))
                consts.append(None)
            else:
                consts.append(a)
        multi = isinstance(out, tuple)
        outs = tuple(self._new(t) for t in (out if multi else (out,)))
        kernel = entry.op.kernel if local_args is not None else None
        self.nodes.append(OpNode(name, kernel, tuple(consts), tuple(slots), dict(attrs), outs,
                                 multi, entry.detach, pl, Mode.now(pl.device_type),
                                 entry.choice.ins, entry.choice.outs, error_rule()))

    def box(self, plan, src: GlobalTensor, out: GlobalTensor) -> None:
        s = self.read(src, "a boxing step")
        self.nodes.append(BoxNode(plan.steps, s, self._new(out), out.placement,
                                  Mode.now(out.placement.device_type)))

    def detach(self, src: GlobalTensor, out: GlobalTensor) -> None:
        s = self.read(src, "detach")
        self.nodes.append(DetachNode(s, self._new(out), out.placement,
                                     Mode.now(out.placement.device_type)))

    def thunk(self, t: GlobalTensor, make) -> None:
        self.nodes.append(ThunkNode(make, self._new(t), t.placement,
                                    Mode.now(t.placement.device_type), self.draws))
        self.draws += 1

    def source(self, load) -> Any:
        """Micro-batch ``micro_batch``'s rows of the next batch of ``load`` (loaded once a
        compile), recorded as a `SourceNode`."""
        i = self.sources
        self.sources += 1
        if i == len(self.batches):
            self.batches.append(load())
        batch = self.batches[i]
        values = source_values(batch)
        if not values or not all(isinstance(v, GlobalTensor) for v in values):
            raise GraphError(f"graph: a data source must give a global tensor, or a tuple, "
                             f"list or dict of them, got {type(batch).__name__}")
        mbs = split_inputs(values, self.micro_batches, [True] * len(values))
        piece = mbs.args[self.micro_batch]
        metas = tuple((tuple(v.shape), v.dtype, v.placement, v.sbp) for v in values)
        pl = values[0].placement
        self.nodes.append(SourceNode(load, i, tuple(self._new(t) for t in piece), metas, pl,
                                     Mode.now(pl.device_type)))
        return source_like(batch, piece)

    def task(self, make, reads: list, outs: list, placement: Placement) -> None:
        """A task another layer records (ZeRO's unit calls, `sbpflow.zero.unit_tasks`):
        ``make(read slots, written slots, mode)`` gives its node, which runs as the others
        (``run(vals, env)``) and names its slots (``slots_read``, ``slots_written``)."""
        r = tuple(self.read(t, "a ZeRO unit's gather") for t in reads)
        o = tuple(self._new(t) for t in outs)
        self.nodes.append(make(r, o, Mode.now(placement.device_type)))

    def module(self, module: Any) -> None:
        self.modules.setdefault(id(module), module)

    def assign(self, dst: GlobalTensor, src: GlobalTensor) -> None:
        """``dst``'s shard is about to take ``src``'s values in place (``src`` already in
        ``dst``'s layout). A tensor build did not make (a buffer, a parameter) is put back as
        it was when the trace ends (`restore`): the first call's replay makes the write."""
        s = self.read(src, "an in-place op")
        d = self.read(dst, "an in-place op")
        local = dst.shard
        if d in self.external_slots and all(w is not local for w, _ in self.written):
            self.written.append((local, local.detach().clone()))
        # a constant build made is made afresh by each eager call: a replay writes a copy
        fresh = id(local) in self.constants
        self.nodes.append(AssignNode(s, d, dst.placement, Mode.now(dst.placement.device_type),
                                     fresh))

    def check_taken(self, t: GlobalTensor) -> None:
        """``t`` is about to hold another shard (an in-place op on a tensor in the autograd
        graph, or on a torch view): refused for a tensor build did not make, whose shard each
        replay re-reads (the new one would be the trace's, never the call's)."""
        slot = self.slot_of.get(id(t.shard))
        if slot is None or slot in self.external_slots:
            raise GraphError(
                f"graph: build changes in place a tensor of shape {t._shape} on "
                f"{t.placement} with sbp {format_nd_sbp(t.sbp)} that it did not compute and "
                f"whose shard is a torch view or in the autograd graph; a graph cannot replay "
                f"that. Write it under torch.no_grad() into a tensor that owns its storage, "
                f"or compute a new tensor")

    def restore(self) -> None:
        """Undo the trace's in-place writes into tensors build did not make (`assign`)."""
        with torch.no_grad():
            for local, before in reversed(self.written):
                local.copy_(before)
        self.written = []

    def guard(self, t: GlobalTensor, check) -> None:
        self.nodes.append(GuardNode(check, self.read(t, "a value check"), t.placement,
                                    Mode.now(t.placement.device_type)))

    def backward(self, loss: GlobalTensor, seed: torch.Tensor) -> None:
        slot = self.read(loss, "backward")
        seed_slot = self.slot_of.get(id(seed))
        node = BackwardNode(slot, seed_slot, None if seed_slot is not None else seed.detach(),
                            loss.placement, Mode.now(loss.placement.device_type))
        self.backwards.append(node)

    # -- the result ----------------------------------------------------------------------------
    def _template(self, value: Any) -> Any:
        if isinstance(value, GlobalTensor):
            return OutSlot(self.read(value, "the graph's output"))
        if isinstance(value, (tuple, list)):
            return rebuild_sequence(value, [self._template(v) for v in value])
        if isinstance(value, dict):
            return {k: self._template(v) for k, v in value.items()}
        return OutConst(value)

    def tape(self, result: Any) -> Tape:
        outputs = self._template(result)
        tape = Tape(self.nodes, tuple(self.inputs), self.externals, self.backwards, outputs,
                    self.metas, len(self.metas), self.draws, tuple(out_slots(outputs)))
        self.keep, self.slot_of, self.untraced = [], {}, set()
        return tape
