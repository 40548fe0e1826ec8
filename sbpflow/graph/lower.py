"""Lowering a `Tape` to stages: which tasks each stage runs, and the transfers between stages.

A stage is a set of ranks: values on placements with the same ranks belong to one stage (a
2-D mesh and its 1-D view are the same devices). Stages must not share ranks. A boxing step list
that changes stage is cut in three: the steps on the source placement (run by the source's
forward), the one transfer step (a send actor on the source, a recv actor on the destination),
the steps on the destination placement (run by the destination's forward). Stages are ordered so
that every transfer goes forward. See docs/runtime.md, 'Graph mode'.
"""

from __future__ import annotations

from typing import NamedTuple

from ..boxing import BoxingStep
from ..errors import GraphError
from ..zero.unit_tasks import link as link_units
from ..placement import Placement
from .nodes import BackwardNode, BoxNode, DetachNode, GuardNode, OpNode, SourceNode, ThunkNode
from .recorder import Meta, Tape

__all__ = ["StageTransfer", "Lowered", "stages_of", "lower", "frees_after"]


class StageTransfer(NamedTuple):
    """A value moving from stage ``src_stage`` (slot ``src``) to ``dst_stage`` (slot ``out``);
    ``grad``: its gradient goes back (the dual step) in backward."""

    step: BoxingStep
    src: int
    out: int
    src_stage: int
    dst_stage: int
    meta: Meta
    grad: bool


class Lowered(NamedTuple):
    """One tape cut into stages: ``forward[s]`` the tasks of stage s in order, ``frees[s][i]``
    the slots to drop after task i (their last use), ``sources[s]`` its data sources (its
    loading actor's), ``transfers`` in tape order, ``backwards[s]`` the backward seeds of stage
    s, ``nslots`` (the tape's and the slots the cuts added)."""

    tape: Tape
    forward: dict
    frees: dict
    sources: dict
    transfers: list
    backwards: dict
    nslots: int

    def into(self, stage: int, src: int | None = None) -> list[StageTransfer]:
        return [t for t in self.transfers
                if t.dst_stage == stage and (src is None or t.src_stage == src)]

    def out_of(self, stage: int, dst: int | None = None) -> list[StageTransfer]:
        return [t for t in self.transfers
                if t.src_stage == stage and (dst is None or t.dst_stage == dst)]


def _ranks(pl: Placement) -> frozenset:
    return frozenset(pl.flat_ranks)


def stages_of(tape: Tape) -> list[frozenset]:
    """The stages (rank sets) of a tape, ordered so that every transfer goes forward (ties: first
    appearance). Raises `GraphError` when two placements share some ranks but not all, or when
    transfers go both ways between stages."""
    sets: list[frozenset] = []
    for pl in _live_placements(tape):
        r = _ranks(pl)
        if r in sets:
            continue
        for other in sets:
            if r & other:
                raise GraphError(
                    f"graph: placements on ranks {sorted(r)} and {sorted(other)} share ranks "
                    f"{sorted(r & other)}; graph mode cuts pipeline stages where the placement "
                    f"changes and needs each stage on its own ranks (or on exactly the same "
                    f"ranks)")
        sets.append(r)
    after: dict[frozenset, set] = {r: set() for r in sets}
    for node in live_nodes(tape):   # (a move nothing reads is no edge: lowering drops it)
        if isinstance(node, BoxNode):
            a, b = _ranks(tape.metas[node.src].placement), _ranks(node.placement)
            if a != b:
                after[a].add(b)
    order: list[frozenset] = []
    state: dict[frozenset, int] = {}

    def visit(r: frozenset) -> None:  # depth-first: a stage goes after all its sources
        if state.get(r) == 2:
            return
        if state.get(r) == 1:
            raise GraphError(f"graph: values go from the stage on ranks {sorted(r)} to later "
                             f"stages and back; pipeline stages must form a chain without "
                             f"cycles (an input given on a stage's placement goes back if "
                             f"an earlier stage reads it: give it where it is first read)")
        state[r] = 1
        for nxt in sorted(after[r], key=sets.index):
            visit(nxt)
        state[r] = 2
        order.append(r)

    for r in sets:
        visit(r)
    return order[::-1]


def _live_placements(tape: Tape) -> list[Placement]:
    """The placements of the values the kept tasks (`live_nodes`) read and write, in order of
    first appearance. A value only Python read during the trace is no stage: ``item()`` or
    ``bool(x)`` moves it to every rank of the world (HF's check for padding without an
    attention mask, ``pad_token_id in input_ids[:, [-1, 0]]``), and the replay, which has
    the answer as a constant, drops that move."""
    slots: set = set()
    for node in live_nodes(tape):
        slots.update(reads(node))
        slots.update(writes(node))
    seen: list[Placement] = []
    for slot, m in tape.metas.items():
        if slot in slots and m.placement not in seen:
            seen.append(m.placement)
    return seen


def lower(tape: Tape, stages: list[frozenset]) -> Lowered:
    """Cut ``tape`` into ``stages`` (from `stages_of`; every tape of one graph gives the same)."""
    index = {r: i for i, r in enumerate(stages)}

    def stage(pl: Placement) -> int:
        try:
            return index[_ranks(pl)]
        except KeyError:
            raise GraphError(f"graph: a value on {pl} is on none of the stages "
                             f"{[sorted(s) for s in stages]} the first micro-batch used "
                             f"(micro-batches of different sizes must use the same "
                             f"placements)") from None

    forward: dict[int, list] = {i: [] for i in range(len(stages))}
    sources: dict[int, list] = {i: [] for i in range(len(stages))}
    transfers: list[StageTransfer] = []
    nslots = tape.nslots
    for node in live_nodes(tape):
        if isinstance(node, SourceNode):
            sources[stage(node.placement)].append(node)
        elif isinstance(node, BoxNode) and stage(tape.metas[node.src].placement) != \
                stage(node.placement):
            nslots = _cut(node, tape, stage, forward, transfers, nslots)
        else:
            forward[stage(node.placement)].append(node)
    forward = {s: link_units(nodes) for s, nodes in forward.items()}   # ZeRO's prefetch
    backwards: dict[int, list[BackwardNode]] = {i: [] for i in range(len(stages))}
    for b in tape.backwards:
        backwards[stage(b.placement)].append(b)
    frees = {s: frees_after(forward[s], _kept(s, tape, transfers, backwards[s]))
             for s in forward}
    return Lowered(tape, forward, frees, sources, transfers, backwards, nslots)


def reads(node) -> tuple:
    """The slots a task reads."""
    if isinstance(node, OpNode):
        return tuple(s for _, s in node.slots)
    if isinstance(node, (BoxNode, DetachNode, GuardNode)):
        return (node.src,)
    return getattr(node, "slots_read", ())   # tasks other layers record (Recorder.task)


def writes(node) -> tuple:
    """The slots a task writes."""
    if isinstance(node, OpNode):
        return node.outs
    if isinstance(node, (BoxNode, DetachNode, ThunkNode)):
        return (node.out,)
    if isinstance(node, SourceNode):
        return node.outs
    return getattr(node, "slots_written", ())


def live_nodes(tape: Tape) -> list:
    """The tasks the outputs and the backward need (value checks, random draws, data sources
    and tasks marked ``keep`` always: they raise, or advance a stream every rank must advance
    alike, or pair with another: ZeRO's unit calls). The moves
    of model inputs into stages that never read them drop out here."""
    need = set(tape.outs)
    for b in tape.backwards:
        need.add(b.loss)
        if b.seed_slot is not None:
            need.add(b.seed_slot)
    live = []
    for node in reversed(tape.nodes):
        if isinstance(node, (GuardNode, ThunkNode, SourceNode)) or \
                getattr(node, "keep", False) or any(w in need for w in writes(node)):
            live.append(node)
            need.update(reads(node))
    return live[::-1]


def _kept(stage: int, tape: Tape, transfers: list, backwards: list) -> set:
    """The slots of a stage's forward that must outlive it: what its sends read, the received
    values whose gradient goes back, its outputs, its backward's losses and seeds."""
    kept = set(tape.outs)
    kept.update(t.src for t in transfers if t.src_stage == stage)
    kept.update(t.out for t in transfers if t.dst_stage == stage and t.grad)
    for b in backwards:
        kept.add(b.loss)
        if b.seed_slot is not None:
            kept.add(b.seed_slot)
    return kept


def frees_after(nodes: list, kept: set) -> list[tuple]:
    """Per task, the slots whose last reader it is (and that nothing after the forward
    reads): dropping them frees what autograd does not keep, as eager's locals going out of
    scope do."""
    last: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for s in reads(node):
            last[s] = i
    out: list[list] = [[] for _ in nodes]
    for s, i in last.items():
        if s not in kept:
            out[i].append(s)
    return [tuple(f) for f in out]


def _cut(node: BoxNode, tape: Tape, stage, forward: dict, transfers: list, nslots: int) -> int:
    """Cut a stage-changing boxing into source steps, one transfer, destination steps."""
    cross = [i for i, st in enumerate(node.steps) if st.kind == "transfer"]
    if len(cross) != 1:
        raise GraphError(f"graph: a boxing between stages has {len(cross)} transfer steps "
                         f"({[st.describe() for st in node.steps]}); expected one")
    i = cross[0]
    meta = tape.metas[node.src]
    a, b = stage(meta.placement), stage(node.placement)
    src = node.src
    if i > 0:  # steps on the source placement, run by the source stage's forward
        src, nslots = nslots, nslots + 1
        forward[a].append(node._replace(steps=node.steps[:i], out=src,
                                        placement=node.steps[i].src_placement))
    out = node.out
    if i + 1 < len(node.steps):
        out, nslots = nslots, nslots + 1
        forward[b].append(node._replace(steps=node.steps[i + 1:], src=out))
    transfers.append(StageTransfer(node.steps[i], src, out, a, b, meta, meta.grad))
    return nslots
