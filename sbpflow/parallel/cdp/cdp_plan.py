"""A run of the CDP schedule as a plan of the actor runtime: the tasks of one window of
``2N`` time steps, on one rank.

Each task is an actor that fires once a run. The rank's F and B actors form a chain in key
order (the time-step table fixes their order; A and U fire as soon as their inputs are there);
an actor also reads the register of the task of its rank that made each value it needs in
this run (a value made in an earlier run is already on the rank). A transfer is a send actor
on its sender's thread for that peer and a receive actor on the receiver's, chained in key
order per pair, so the point-to-point messages pair up. Under ZeRO a version's relay waits,
on both ranks, for the rank's op before it in key order, and the sender's next op waits for
it: a copy travels as the workers reach the ops that use it. Other ranks of the trainer get
an idle actor each (the plan's peers, which a failure aborts). See docs/cdp.md, 'How it runs'.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from ...runtime import ActorSpec, Input, Plan
from .program import PARAMS, Transfer, Work
from .rank_state import RankState

__all__ = ["window_plan"]

_KIND = {"F": "forward", "B": "backward", "A": "compute", "U": "update"}


def _idle(_mb: int) -> None:
    return None


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


def _gate(t: Transfer, chain: Sequence[Work], keys: list, zero: bool) -> list[Input]:
    """ZeRO's relays: the rank's chained op just before the transfer in key order (none in
    this run: it is done), so a copy moves when the workers reach it."""
    if not zero or t.payload[0] not in PARAMS:
        return []
    k = bisect.bisect_left(keys, t.key)
    return [Input(chain[k - 1].name)] if k else []


def _send_name(t: Transfer, k: int) -> str:
    return f"send>{t.dst}#{k}"


def _recv_name(t: Transfer, k: int) -> str:
    return f"recv<{t.src}#{k}"


def _transfer_specs(state: RankState, sends: Sequence[Transfer], recvs: Sequence[Transfer],
                    recv_names: Sequence[str], made: dict, chained: Sequence[Work]
                    ) -> tuple[list[ActorSpec], dict[str, list[Input]]]:
    """The send and receive actors, and the inputs they add to chained ops: under ZeRO the
    rank's next op waits for each relay it sends on, so a copy is gone before that op."""
    keys = [w.key for w in chained]
    zero = state.roles.mode == "zero"
    specs, waits = [], {}
    last: dict[int, str] = {}
    count: dict[int, int] = {}
    for t in sends:
        k = count[t.dst] = count.get(t.dst, -1) + 1
        nm = _send_name(t, k)
        inputs = _inputs(nm, t.key, [t.payload], made, last.get(t.dst))
        inputs += [g for g in _gate(t, chained, keys, zero) if g not in inputs]
        specs.append(ActorSpec(nm, "send", state.actor_fn(state.send, t, nm), stage=t.stage,
                               inputs=inputs, outputs=1, queue=f"to{t.dst}"))
        last[t.dst] = nm
        after = bisect.bisect_right(keys, t.key)
        if zero and t.payload[0] in PARAMS and t.payload[1] in state.relayed_stages \
                and after < len(chained):
            waits.setdefault(chained[after].name, []).append(Input(nm))
    last = {}
    for t, nm in zip(recvs, recv_names):
        inputs = [Input(last[t.src])] if t.src in last else []
        inputs += _gate(t, chained, keys, zero)
        specs.append(ActorSpec(nm, "recv", state.actor_fn(state.recv, t, nm), stage=t.stage,
                               inputs=inputs, outputs=1, queue=f"from{t.src}"))
        last[t.src] = nm
    return specs, waits


def window_plan(name: str, rank: int, ranks: Sequence[int], works: Sequence[Work],
                moves: Sequence[Transfer], state: RankState) -> Plan:
    """``rank``'s actors for a run of ``works`` / ``moves`` (relative tasks of every rank,
    in key order); ``state`` runs them."""
    mine = [w for w in works if w.rank == rank]
    sends = [t for t in moves if t.src == rank]
    recvs = [t for t in moves if t.dst == rank]
    made: dict[tuple, tuple[str, tuple]] = {}   # value -> (actor, key) that makes it here
    count: dict[int, int] = {}
    recv_names = []
    for t in recvs:
        k = count[t.src] = count.get(t.src, -1) + 1
        recv_names.append(_recv_name(t, k))
        made[t.payload] = (recv_names[-1], t.key)
    for w in mine:
        for value in w.makes:
            made[value] = (w.name, w.key)
    chained = [w for w in mine if w.chained]
    moved, waits = _transfer_specs(state, sends, recvs, recv_names, made, chained)
    specs, chain = [], None
    fns = {"F": state.forward, "B": state.backward, "A": state.accumulate, "U": state.update}
    for w in mine:
        inputs = _inputs(w.name, w.key, w.needs, made, chain if w.chained else None)
        inputs += waits.get(w.name, [])
        specs.append(ActorSpec(w.name, _KIND[w.kind], state.actor_fn(fns[w.kind], w, w.name),
                               stage=w.stage, inputs=inputs, outputs=1))
        if w.chained:
            chain = w.name
    specs += moved
    actors = {r: [ActorSpec("idle", "compute", _idle)] for r in ranks if r != rank}
    actors[rank] = specs or [ActorSpec("idle", "compute", _idle)]
    return Plan(actors, name=name)
