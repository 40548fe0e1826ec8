"""Progress records: which collective each rank has reached, and what else it is doing, to name
the ranks a timeout waited for.

Each rank numbers the collectives of each of its process groups in call order (so #n is the
same call on every member); the record holds the open ones exactly (an asynchronous one is
open until waited for or dropped), with the thread in each. Beside them, the rank's `Activity`:
the actor runs in progress (which thread is inside which actor, at which micro-batch, since
when), the last run that ended, the last sbpflow op started. Entering and leaving touches only
this rank's record in memory; a daemon thread writes it to the c10d store when it changed, at
most every ``period`` seconds, so the collectives never wait on the store. On a timeout,
`Progress.inquire` reads the members' records, says what each was doing and names the culprits:
the ranks that had not entered the collective, or (no common collective: point-to-point, an
actor's wait) those that wait for no one (`stuck`). See docs/internals.md, 'Progress records'.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections import deque
from typing import Any, NamedTuple, Sequence

import torch.distributed as dist

__all__ = ["P2P", "Activity", "Finding", "Progress", "awaiting", "blame", "group_key",
           "period_for", "stuck"]

P2P = "p2p"  # the record key of point-to-point exchanges (not numbered across ranks)
_PREFIX = "sbpflow/progress/"
_IO_TIMEOUT = datetime.timedelta(seconds=10)  # a store that does not answer in 10 s is gone


def group_key(ranks: Sequence[int], cuda: bool = False) -> str:
    """The record key of the process group of ``ranks`` (any order) on gloo, or NCCL (``cuda``):
    the two have separate call orders."""
    return "_".join(map(str, sorted(ranks))) + ("/cuda" if cuda else "")


def period_for(timeout: float) -> float:
    """Seconds between publications for a collective ``timeout``: a tenth of it, 1 s at most."""
    return min(1.0, max(0.05, timeout / 10))


def own_connection(store: dist.Store, timeout: datetime.timedelta) -> dist.Store:
    """The job-wide root of ``store`` (every rank reads the others' keys there) with a
    connection of its own (``clone``: safe beside the caller's own use, e.g. a rendezvous blocked
    in ``wait``) and ``timeout``; a store that cannot be cloned is shared as it is."""
    root = store
    while isinstance(root, dist.PrefixStore):
        root = root.underlying_store
    try:
        conn = root.clone()
        conn.set_timeout(timeout)
    except (RuntimeError, AttributeError):
        return root
    return conn


class Finding(NamedTuple):
    """What a timeout found out about the ranks it waited for: ``text`` (what each was doing)
    and ``culprits``, the ranks it names as the cause (they did not arrive, or wait for no one
    while others wait for them)."""

    text: str
    culprits: tuple[int, ...] = ()


class Activity:
    """What a rank does besides collectives: its actor runs in progress, the last one that
    ended, the last sbpflow op it started. One per communicator (``Communicator.activity``).

    The writers touch memory only: a run registers itself when it starts (`started`) and
    leaves when it ends (`ended`); while it runs it is read live (``run.doing()``, by the
    reader's thread, without a lock), so a firing writes nothing here; an op dispatch stores
    its name in ``op``. Readers: the rank's `Progress` thread, which publishes `snapshot`, and
    the threads backend's description of a rank. A run is any object with ``label()`` (its
    text, "run 2 of plan 'p'") and ``doing()`` returning ``(label, started, busy, peers)``:
    its text, its start (``time.perf_counter()``), its threads inside an actor's function,
    each ``(thread, actor text, micro-batch, since)``, where ``thread`` is a
    `threading.Thread`, and the ranks whose messages its waiting actors wait for.
    """

    __slots__ = ("op", "_runs", "_last")

    def __init__(self) -> None:
        self.op: str | None = None
        self._runs: dict[int, Any] = {}   # id(run) -> run
        self._last: tuple[str, float] | None = None  # (label, ended at) of the last run ended

    def started(self, run: Any) -> None:
        self._runs[id(run)] = run

    def ended(self, run: Any) -> None:
        if self._runs.pop(id(run), None) is not None:
            self._last = (run.label(), time.perf_counter())

    def snapshot(self, threads: bool = False) -> dict:
        """``{"runs": [[label, started, [[thread name, actor, micro-batch, since], ...],
        peers], ...], "last_run": [label, ended] or None, "op": op}``, times
        ``time.perf_counter()`` (``threads``: the `threading.Thread` objects, not names)."""
        runs = []
        for run in list(self._runs.values()):  # (a copy: runs start and end meanwhile)
            try:
                label, since, busy, peers = run.doing()
            except RuntimeError:  # a container it reads changed meanwhile: next time
                continue
            runs.append([label, since, [[t if threads else t.name, what, mb, at]
                                        for t, what, mb, at in busy], list(peers)])
        return {"runs": runs, "last_run": list(self._last) if self._last else None,
                "op": self.op}


def _named(groups: dict) -> dict:
    """The groups of a record with each open call's thread id replaced by the thread's name
    (as published)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {k: {**g, "open": {seq: e[:3] + [names.get(e[3], str(e[3]))] + e[4:]
                              for seq, e in g["open"].items()}} for k, g in groups.items()}


def _aged(snap: dict, now: float) -> dict:
    """`Activity.snapshot` with its times as seconds before ``now`` (the record's clock-free
    form: ``time.perf_counter`` is not comparable across machines)."""
    return {"runs": [[label, now - since, [[t, what, mb, now - at] for t, what, mb, at in busy],
                      peers] for label, since, busy, peers in snap["runs"]],
            "last_run": [snap["last_run"][0], now - snap["last_run"][1]]
            if snap["last_run"] else None, "op": snap["op"]}


class Progress:
    """One rank's progress through the collectives of its process groups, published to ``store``.

    ``enter(key, kind)`` numbers a collective of group ``key`` (`group_key`), opens it and
    returns its number; ``leave(key, seq)`` closes that one (in any order: collectives started
    asynchronously, ``enter(..., waiting=False)``, may finish after later ones; ``blocked``
    marks such a one as waited for, ``dropped`` as abandoned unwaited). ``activity``: the
    rank's `Activity`, published with the record. ``inquire(members, ...)`` says, after a
    timeout, what the members were doing and names the culprits; ``report`` is its text.
    ``close()`` publishes a final record (marked closed) and stops the thread.
    """

    def __init__(self, rank: int, store: dist.Store, period: float,
                 activity: Activity | None = None) -> None:
        self.rank, self.period = rank, period
        self.activity = Activity() if activity is None else activity
        self._store = dist.PrefixStore(_PREFIX, own_connection(store, _IO_TIMEOUT))
        self._lock = threading.Lock()  # the record
        self._io = threading.Lock()  # the store connection (the thread's and report's reads)
        # key -> {"n": last entered seq, "open": {seq: [kind, entered at, waiting for it,
        #         the id of the thread that entered or waits in it, the members (or peers)]},
        #         "last": [seq, kind, finished at] of the last one closed, or None}
        self._groups: dict[str, dict] = {}
        self._dropped: deque[tuple[str, int]] = deque()  # (key, seq): closed at publication
        self._version = 0
        self._published = -1
        self._doing: dict | None = None  # the activity snapshot last published
        self._made = time.time()
        self._closed = False
        self._stop = threading.Event()
        self.publish()  # "no collective yet" differs from "no record" (never started)
        self._thread = threading.Thread(target=self._loop, name=f"sbpflow-progress-{rank}",
                                        daemon=True)
        self._thread.start()

    # -- the hot path: memory only ----------------------------------------------------------
    def enter(self, key: str, kind: str, waiting: bool = True,
              members: Sequence[int] = ()) -> int:
        """Record that this rank entered the next collective of ``key`` (``waiting``: blocked
        in it; False: started asynchronously, see `blocked`) among ``members`` (point-to-point:
        the peers), on the calling thread; return its number."""
        thread = threading.get_ident()  # (named at publication: `_named`)
        with self._lock:
            g = self._groups.get(key)
            if g is None:
                g = self._groups[key] = {"n": 0, "open": {}, "last": None}
            seq = g["n"] = g["n"] + 1
            g["open"][seq] = [kind, time.time(), waiting, thread, members]
            self._version += 1
            return seq

    def blocked(self, key: str, seq: int) -> None:
        """Record that this rank now waits for collective ``seq`` of ``key``, which it started
        asynchronously (``enter(..., waiting=False)``), on the calling thread."""
        thread = threading.get_ident()
        with self._lock:
            entry = self._groups[key]["open"].get(seq)
            if entry is not None:
                entry[2], entry[3] = True, thread
                self._version += 1

    def leave(self, key: str, seq: int) -> None:
        """Record that collective ``seq`` of ``key`` finished, failed, or was abandoned on this
        rank; the others stay open whatever their numbers. A second call does nothing."""
        with self._lock:
            g = self._groups[key]
            entry = g["open"].pop(seq, None)
            if entry is not None:
                g["last"] = [seq, entry[0], time.time()]
                self._version += 1

    def dropped(self, key: str, seq: int) -> None:
        """Record that collective ``seq`` of ``key``, started asynchronously, was dropped
        unwaited (its handle was garbage collected): this rank will never wait in it. Takes no
        lock, so a garbage collector's callback may call it on any thread at any moment; the
        record closes it (without making it the last one finished) when next published."""
        self._dropped.append((key, seq))

    # -- publication ----------------------------------------------------------------------------
    def _serialized(self) -> tuple[str, int, dict]:
        """This rank's record as JSON, its version and the activity snapshot in it."""
        snap = self.activity.snapshot()
        with self._lock:
            while self._dropped:
                key, seq = self._dropped.popleft()
                self._groups[key]["open"].pop(seq, None)
            return json.dumps({"t": time.time(), "made": self._made, "closed": self._closed,
                               "groups": _named(self._groups),
                               "doing": _aged(snap, time.perf_counter())}), self._version, snap

    def publish(self) -> None:
        """Write this rank's record to the store now."""
        data, version, snap = self._serialized()
        with self._io:
            self._store.set(str(self.rank), data)
        self._published, self._doing = version, snap

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            if (self._dropped or self._version != self._published
                    or self.activity.snapshot() != self._doing):
                try:
                    self.publish()
                except RuntimeError:  # the store is gone (the job is ending): nowhere to write
                    return

    def close(self) -> None:
        """Publish a final record, marked closed, and stop publishing. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            self._closed = True
            self._version += 1
        try:
            self.publish()
        except RuntimeError:
            pass
        self._thread.join(timeout=self.period + 1)

    # -- the failure path -------------------------------------------------------------------------
    def read(self, ranks: Sequence[int]) -> dict[int, dict | None]:
        """The latest published record of each of ``ranks`` (None: it never published one)."""
        out: dict[int, dict | None] = {}
        with self._io:
            for r in ranks:
                k = str(r)
                out[r] = json.loads(self._store.get(k)) if self._store.check([k]) else None
        return out

    def report(self, key: str, seq: int | None, members: Sequence[int]) -> str:
        """`inquire`'s text (what the members were doing), for collective ``seq`` of group
        ``key`` (None: no common collective)."""
        return self.inquire(members, key, seq).text

    def inquire(self, members: Sequence[int], key: str | None = None, seq: int | None = None,
                threshold: float | None = None) -> Finding:
        """After a timeout: what each of ``members`` was doing and who is to blame.

        With collective ``seq`` of group ``key``: which members had entered it, and what each
        of the others was doing; they are the culprits. Without (``seq=None``: point-to-point,
        an actor's wait): what each other member was doing; given a ``threshold``, the waits
        of those that wait are followed (the ranks they wait for, and so on), and the culprits
        are the ranks met that wait for no one (`stuck`, ``threshold`` s at least), described
        too; this rank among them (a receive of its own may wait for a peer that waits for
        its compute thread). Publishes this rank's record, waits 1.5 periods (the others'
        threads publish any change older than that), then reads the records; a rank that
        changed since is counted as it was. Never raises: a store that cannot be read is
        said so in the text (and no rank is blamed).
        """
        others = [r for r in members if r != self.rank]
        try:
            self.publish()
            time.sleep(1.5 * self.period + 0.05)
            records = self.read(others)
        except RuntimeError as exc:
            return Finding(f"the other ranks' progress records could not be read ({exc})")
        now = time.time()
        if seq is None:
            culprits: tuple[int, ...] = ()
            if threshold is not None:
                records[self.rank] = json.loads(self._serialized()[0])
                try:
                    chain = self._follow(records, others)
                except RuntimeError:  # the store went away meanwhile: blame the ones read
                    chain = list(records)
                culprits = tuple(r for r in chain if stuck(records[r], now, threshold))
            shown = others + [r for r in culprits if r not in others]
            text = "; ".join(f"rank {r}{' (this rank)' * (r == self.rank)}: "
                             f"{_activity(records[r], now)}" for r in shown)
            if culprits:
                text += f"; {blame(culprits)}"
            return Finding(text, culprits)
        arrived = sorted([self.rank] + [r for r in others if _entered(records[r], key) >= seq])
        missing = [r for r in others if r not in arrived]
        if not missing:
            return Finding(f"every member had entered it (ranks {arrived}): a member is slow "
                           f"inside it, or a network failure")
        why = "; ".join(f"rank {r}: {_reached(records[r], key)}, {_activity(records[r], now)}"
                        for r in missing)
        return Finding(f"rank(s) {missing} did not arrive ({why}); arrived: {arrived}",
                       tuple(missing))

    def _follow(self, records: dict, start: list[int]) -> list[int]:
        """``start`` and, transitively, the ranks they wait for (`_waits_for`), in the order
        met; reads the records of those not in ``records`` yet (into it)."""
        seen = list(start)
        for r in seen:  # (grows while read)
            new = [m for m in dict.fromkeys(_waits_for(records[r])) if m not in seen]
            records.update(self.read([m for m in new if m not in records]))
            seen += new
        return seen


def _waits_for(record: dict | None) -> list[int]:
    """The ranks ``record``'s rank waits for: the members (peers) of the calls it waits in,
    the ranks whose messages its actor runs wait for."""
    record = record or {}
    calls = [m for g in record.get("groups", {}).values() for e in g["open"].values()
             if e[2] and len(e) > 4 for m in e[4]]
    return calls + [m for run in (record.get("doing") or {}).get("runs", ()) for m in run[3]]


def blame(culprits: Sequence[int]) -> str:
    """The sentence a timeout's text ends with when it names ``culprits`` that wait for no one."""
    return (f"rank(s) {list(culprits)} wait(s) for no other rank: the others wait for "
            f"{'it' if len(culprits) == 1 else 'them'}")


def stuck(record: dict | None, now: float, threshold: float) -> bool:
    """Whether the rank of ``record`` waits for no other rank, for ``threshold`` s at least:
    it never published a record, its communicator is closed, a thread of it has been inside an
    actor's function and outside communication that long, or it is in no collective and no
    actor run (busy in its own code) and has been since its last collective or run ended."""
    if record is None or record["closed"]:
        return True
    late = now - record["t"]  # seconds since it was published: ages grew by that much
    inside = _waiting_threads(record)
    doing = record.get("doing") or {"runs": [], "last_run": None}
    for _label, _since, busy, _peers in doing["runs"]:
        if any(t not in inside and age + late >= threshold for t, _a, _mb, age in busy):
            return True
    if inside or doing["runs"]:
        return False
    ends = [now - g["last"][2] for g in record["groups"].values() if g["last"]]
    if doing["last_run"]:
        ends.append(doing["last_run"][1] + late)
    return min(ends, default=now - record.get("made", record["t"])) >= threshold


def _waiting_threads(record: dict) -> set[str]:
    """The threads of ``record``'s rank that wait in a collective or point-to-point call."""
    return {e[3] for g in record["groups"].values() for e in g["open"].values()
            if e[2] and len(e) > 3}


def _entered(record: dict | None, key: str) -> int:
    """The last collective of ``key`` that ``record``'s rank entered (0: none)."""
    g = (record or {}).get("groups", {}).get(key)
    return g["n"] if g else 0


def _reached(record: dict | None, key: str) -> str:
    n = _entered(record, key)
    return f"entered #{n} of that group last" if n else "entered none of that group's collectives"


def _where(key: str) -> str:
    if key == P2P:
        return ""
    ranks, _, dev = key.partition("/")
    return f" over ranks [{ranks.replace('_', ', ')}]" + (f" ({dev})" if dev else "")


def _activity(record: dict | None, now: float) -> str:
    """What a rank was doing, from its record: the collectives it waits in, else the last one
    it finished and for how long it has been out of collectives; then those it started
    asynchronously and has not waited for yet; then its actor runs (`_runs`), or, out of them,
    the last sbpflow op it started."""
    if record is None:
        return ("no progress record (its communicator was never created, or cannot reach the "
                "store)")
    groups, inside, started = record["groups"], [], []
    for k, g in groups.items():
        for seq, (kind, at, waiting, *_) in sorted(g["open"].items(), key=lambda kv: int(kv[0])):
            if waiting:
                inside.append(f"inside {kind}{_where(k)} (#{seq}) for {now - at:.1f} s")
            else:
                started.append(f"{kind}{_where(k)} (#{seq}) started {now - at:.1f} s ago, "
                               f"not waited for yet")
    parts = [", ".join(inside) if inside else _idle(record, now)] + started
    parts += _runs(record, now)
    doing = record.get("doing") or {}
    if doing.get("op") is not None and not doing["runs"]:  # (an eager op: not in a run)
        parts.append(f"the last sbpflow op it started: {doing['op']!r}")
    if record["closed"]:
        parts.append("its communicator is closed (its function returned or failed)")
    return "; ".join(parts)


def _runs(record: dict, now: float) -> list[str]:
    """The actor runs of ``record``'s rank: for each in progress, its threads inside an
    actor's function (outside communication, or waiting in it); else the last run ended."""
    doing = record.get("doing")
    if not doing:
        return []
    late, inside = now - record["t"], _waiting_threads(record)
    out = []
    for label, age, busy, peers in doing["runs"]:
        threads = [f"its thread {t!r} is inside {what}, micro-batch {mb}, for {a + late:.1f} s"
                   + ("" if t in inside else ", outside communication (in its own code)")
                   for t, what, mb, a in busy]
        out.append(f"in {label} for {age + late:.1f} s: "
                   + (", and ".join(threads) if threads else
                      f"no actor inside its function ({awaiting(peers)})"))
    if not out and doing["last_run"]:
        label, age = doing["last_run"]
        out.append(f"out of the actor runtime for {age + late:.1f} s (its last: {label})")
    return out


def awaiting(peers: Sequence[int]) -> str:
    """An actor run's wait for messages, in words (`Activity`'s ``peers``)."""
    return f"waiting for messages from rank(s) {list(peers)}" if peers else \
        "waiting for other ranks' messages"


def _idle(record: dict, now: float) -> str:
    """What a rank waiting in no collective was doing: since when, after which collective
    (busy in its own code, unless an actor run of it is in progress: `_runs` says)."""
    done = [(g["last"], k) for k, g in record["groups"].items() if g["last"]]
    hint = "" if (record.get("doing") or {}).get("runs") else \
        ": busy outside sbpflow's collectives, or calling different ones"
    if done:
        (seq, kind, at), k = max(done, key=lambda lk: lk[0][2])
        return f"in no collective for {now - at:.1f} s (its last: {kind}{_where(k)} #{seq}){hint}"
    if record["groups"]:
        return "in no collective (none finished yet)" + (hint and ": busy outside sbpflow's "
                                                                  "collectives")
    made = record.get("made", record["t"])
    return f"no collective yet, {now - made:.1f} s after its communicator was made"
