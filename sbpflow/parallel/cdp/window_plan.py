"""A run of the CDP schedule as a plan of the actor runtime: the tasks of one window of
``2N`` time steps, on one rank.

Each task is an actor that fires once a run. The rank's F and B actors form a chain in key
order (A and U fire as soon as their inputs are there); an actor also reads the register of
the task of its rank that made each value it needs in this run (one made in an earlier run
is already on the rank). An activation or its gradient (`DIRECT`) whose consumer runs in the
same run goes from its producer's register straight to the consumer (the runtime's own
message, `_fused`); one whose consumer runs in the next run, by a send and a receive actor
on the compute threads. Parameters and gradient sums go by point-to-point exchange on a
thread for that peer, chained in key order per pair; under ZeRO a relay waits, on both
ranks, for the rank's op before it in key order, and the sender's next op waits for it.
Other ranks get stubs of the actors this rank's direct transfers join (or an idle actor):
the plan's peers, which a failure aborts. See docs/cdp.md, 'How it runs'.
"""

from __future__ import annotations

import bisect
import functools
from typing import Sequence

from ...runtime import ActorSpec, Input, Plan
from .program import PARAMS, PeerTransfer, Work
from .rank_state import RankState

__all__ = ["window_plan", "DIRECT"]

_KIND = {"F": "forward", "B": "backward", "A": "compute", "U": "update"}
# values sent in the runtime's messages: each is waited for by the receiver's next chained
# op, so one thread hop less a transfer matters (pp, mp); parameters and gradient sums keep
# the communicator's point-to-point (counted as "p2p" by sf.comm.stats)
DIRECT = ("act", "gact")


def _idle(_mb: int) -> None:
    return None


def _direct(t: PeerTransfer) -> bool:
    return t.payload[0] in DIRECT


def _inputs(own: str, key: tuple, needs: Sequence[tuple], made: dict, chain: str | None
            ) -> list[Input]:
    """The registers an actor reads: the chain's previous actor, then the producer in this
    run of each value it needs (only producers ordered before it)."""
    names = [chain] if chain else []
    for value in needs:
        p = made.get(value)
        if p is not None and p[1] < key and p[0] not in names and p[0] != own:
            names.append(p[0])
    return [Input(n) for n in names]


def _gate(t: PeerTransfer, chain: Sequence[Work], keys: list, zero: bool) -> list[Input]:
    """ZeRO's relays: the rank's chained op just before the transfer in key order (none in
    this run: it is done), so a copy moves when the workers reach it."""
    if not zero or t.payload[0] not in PARAMS:
        return []
    k = bisect.bisect_left(keys, t.key)
    return [Input(chain[k - 1].name)] if k else []


def _names(moves: Sequence[PeerTransfer]) -> list[tuple[str, str]]:
    """Each transfer's send and receive actor names: ``send>{dst}#{k}`` on its sender and
    ``recv<{src}#{k}`` on its receiver, ``k`` counting the pair's transfers in key order
    (every rank names every transfer alike)."""
    count: dict[tuple[int, int], int] = {}
    out = []
    for t in moves:
        k = count[(t.src, t.dst)] = count.get((t.src, t.dst), -1) + 1
        out.append((f"send>{t.dst}#{k}", f"recv<{t.src}#{k}"))
    return out


def _send_specs(state: RankState, sends: Sequence[tuple[PeerTransfer, str]], made: dict,
                chained: Sequence[Work]) -> tuple[list[ActorSpec], dict[str, list[Input]]]:
    """The send actors, and the inputs they add to chained ops: under ZeRO the rank's next op
    waits for each relay it sends on, so a copy is gone before that op."""
    keys = [w.key for w in chained]
    zero = state.roles.mode == "zero"
    specs, waits, last = [], {}, {}
    for t, nm in sends:
        inputs = _inputs(nm, t.key, [t.payload], made, last.get(t.dst))
        inputs += [g for g in _gate(t, chained, keys, zero) if g not in inputs]
        specs.append(ActorSpec(nm, "send", state.actor_fn(state.send, t, nm), stage=t.stage,
                               inputs=inputs, outputs=1, queue=f"to{t.dst}"))
        last[t.dst] = nm
        after = bisect.bisect_right(keys, t.key)
        if zero and t.payload[0] in PARAMS and t.payload[1] in state.relayed_stages \
                and after < len(chained):
            waits.setdefault(chained[after].name, []).append(Input(nm))
    return specs, waits


def _recv_specs(state: RankState, recvs: Sequence[tuple[PeerTransfer, str, str]],
                chained: Sequence[Work]) -> list[ActorSpec]:
    """The receive actors (``recvs``: each transfer with its send's and its own name)."""
    keys = [w.key for w in chained]
    zero = state.roles.mode == "zero"
    specs, last = [], {}
    for t, send, nm in recvs:
        if _direct(t):  # the value comes in the producer's req, to the compute thread
            specs.append(ActorSpec(nm, "recv", state.actor_fn(state.deliver, t, nm, True),
                                   stage=t.stage, inputs=[Input(send, rank=t.src)],
                                   outputs=1, queue="compute"))
            continue
        inputs = [Input(last[t.src])] if t.src in last else []
        inputs += _gate(t, chained, keys, zero)
        specs.append(ActorSpec(nm, "recv", state.actor_fn(state.recv, t, nm), stage=t.stage,
                               inputs=inputs, outputs=1, queue=f"from{t.src}"))
        last[t.src] = nm
    return specs


def _fused(works: Sequence[Work], moves: Sequence[PeerTransfer]) -> dict:
    """The direct transfers, each leaving from its producer's actor (no send actor), to its
    consumer's when that runs in this run too, else to a receive actor. ``{transfer:
    (producer, consumer or None)}``; every rank works out the same."""
    makers = {(v, w.rank): w for w in works for v in w.makes}
    readers = {(v, w.rank): w for w in works for v in w.needs}
    out = {}
    for t in moves:
        if _direct(t):  # made by an op of the run: a transfer's step is its producer's
            out[t] = (makers[(t.payload, t.src)], readers.get((t.payload, t.dst)))
    return out


def _stubs(rank: int, ranks: Sequence[int], moves: Sequence[PeerTransfer],
           names: Sequence[tuple[str, str]], fused: dict) -> dict[int, list[ActorSpec]]:
    """The other ranks' actors that this rank's direct transfers join (their functions never
    run here): the producers (or sends) it receives from, the consumers (whose first input
    is the value) or receives it sends to."""
    out: dict[int, dict[str, ActorSpec]] = {r: {} for r in ranks if r != rank}
    for t, (send, recv) in zip(moves, names):
        if not _direct(t):
            continue
        if t in fused:
            producer, consumer = fused[t]
            send, recv = producer.name, consumer.name if consumer else recv
        if t.dst == rank:
            out[t.src].setdefault(send, ActorSpec(send, "send", _idle, stage=t.stage,
                                                  outputs=1))
        elif t.src == rank:
            out[t.dst][recv] = ActorSpec(recv, "recv", _idle, stage=t.stage, outputs=1,
                                         inputs=[Input(send, rank=rank)])
    return {r: list(specs.values()) or [ActorSpec("idle", "compute", _idle)]
            for r, specs in out.items()}


def _op_spec(state: RankState, w: Work, inputs: list[Input], fused: dict) -> ActorSpec:
    """The actor of op ``w``: it returns the value of the transfer it makes when that one
    is fused (`_fused`), and takes the value of one it reads as its first input."""
    fns = {"F": state.forward, "B": state.backward, "A": state.accumulate, "U": state.update}
    out_t = next((t for t, (p, _) in fused.items() if p is w), None)
    in_t = next((t for t, (_, c) in fused.items() if c is w), None)
    if in_t is not None:
        inputs = [Input(fused[in_t][0].name, rank=in_t.src)] + inputs
    if in_t is None and out_t is None:
        fn = state.actor_fn(fns[w.kind], w, w.name)
    else:
        fn = state.actor_fn(functools.partial(state.fused_op, fns[w.kind], in_t, out_t), w,
                            w.name, True)
    return ActorSpec(w.name, _KIND[w.kind], fn, stage=w.stage, inputs=inputs, outputs=1)


def window_plan(name: str, rank: int, ranks: Sequence[int], works: Sequence[Work],
                moves: Sequence[PeerTransfer], state: RankState) -> Plan:
    """``rank``'s actors for a run of ``works`` / ``moves`` (relative tasks of every rank,
    in key order); ``state`` runs them. A queue's actors are listed in key order: its
    thread fires the first that can, so a send goes before the next op."""
    mine = [w for w in works if w.rank == rank]
    names = _names(moves)
    fused = _fused(works, moves)
    sends = [(t, s) for t, (s, _) in zip(moves, names) if t.src == rank and t not in fused]
    recvs = [(t, fused[t][0].name if t in fused else s, r) for t, (s, r) in zip(moves, names)
             if t.dst == rank and (t not in fused or fused[t][1] is None)]
    made: dict[tuple, tuple[str, tuple]] = {}   # value -> (actor, key) that makes it here
    for t, _, nm in recvs:
        made[t.payload] = (nm, t.key)
    for w in mine:
        for value in w.makes:
            made[value] = (w.name, w.key)
    chained = [w for w in mine if w.chained]
    send_specs, waits = _send_specs(state, sends, made, chained)
    recv_specs = _recv_specs(state, recvs, chained)
    keyed, chain = [], None
    for w in mine:
        inputs = _inputs(w.name, w.key, w.needs, made, chain if w.chained else None)
        inputs += waits.get(w.name, [])
        keyed.append((w.key, _op_spec(state, w, inputs, fused)))
        if w.chained:
            chain = w.name
    keyed += [(t.key, s) for (t, _), s in zip(sends, send_specs)]
    keyed += [(t.key, s) for (t, _, _), s in zip(recvs, recv_specs)]
    specs = [s for _, s in sorted(keyed, key=lambda e: e[0])]
    actors = _stubs(rank, ranks, moves, names, fused)
    actors[rank] = specs or [ActorSpec("idle", "compute", _idle)]
    # inline: the actors wait only in the communicator, so a rank whose actors share one
    # queue and talk to no other rank (mode single) runs them on the calling thread
    return Plan(actors, name=name, inline=True)
