"""Progress records: which collective each rank has reached, to name the ranks a timeout waited for.

Each rank numbers the collectives of each of its process groups in call order (so #n is the
same call on every member); the record holds the open ones exactly (an asynchronous one is
open until waited for or dropped). Entering and leaving touches only this rank's record
in memory; a daemon thread writes it to the c10d store when it changed, at most every
``period`` seconds, so the collectives never wait on the store. On a timeout,
`Progress.report` reads the members' records and names the ranks that had not entered the
collective, with what each was doing. See docs/internals.md, 'Progress records'.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections import deque
from typing import Sequence

import torch.distributed as dist

__all__ = ["P2P", "Progress", "group_key", "period_for"]

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


class Progress:
    """One rank's progress through the collectives of its process groups, published to ``store``.

    ``enter(key, kind)`` numbers a collective of group ``key`` (`group_key`), opens it and
    returns its number; ``leave(key, seq)`` closes that one (in any order: collectives started
    asynchronously, ``enter(..., waiting=False)``, may finish after later ones; ``blocked``
    marks such a one as waited for, ``dropped`` as abandoned unwaited). ``report(key, seq, members)`` says, after a timeout,
    which members had entered collective ``seq`` and what the others were doing. ``close()``
    publishes a final record (marked closed) and stops the thread.
    """

    def __init__(self, rank: int, store: dist.Store, period: float) -> None:
        self.rank, self.period = rank, period
        self._store = dist.PrefixStore(_PREFIX, own_connection(store, _IO_TIMEOUT))
        self._lock = threading.Lock()  # the record
        self._io = threading.Lock()  # the store connection (the thread's and report's reads)
        # key -> {"n": last entered seq, "open": {seq: [kind, entered at, waiting for it]},
        #         "last": [seq, kind, finished at] of the last one closed, or None}
        self._groups: dict[str, dict] = {}
        self._dropped: deque[tuple[str, int]] = deque()  # (key, seq): closed at publication
        self._version = 0
        self._published = -1
        self._closed = False
        self._stop = threading.Event()
        self.publish()  # "no collective yet" differs from "no record" (never started)
        self._thread = threading.Thread(target=self._loop, name=f"sbpflow-progress-{rank}",
                                        daemon=True)
        self._thread.start()

    # -- the hot path: memory only ----------------------------------------------------------
    def enter(self, key: str, kind: str, waiting: bool = True) -> int:
        """Record that this rank entered the next collective of ``key`` (``waiting``: blocked
        in it; False: started asynchronously, see `blocked`); return its number."""
        with self._lock:
            g = self._groups.get(key)
            if g is None:
                g = self._groups[key] = {"n": 0, "open": {}, "last": None}
            seq = g["n"] = g["n"] + 1
            g["open"][seq] = [kind, time.time(), waiting]
            self._version += 1
            return seq

    def blocked(self, key: str, seq: int) -> None:
        """Record that this rank now waits for collective ``seq`` of ``key``, which it started
        asynchronously (``enter(..., waiting=False)``)."""
        with self._lock:
            entry = self._groups[key]["open"].get(seq)
            if entry is not None:
                entry[2] = True
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
    def publish(self) -> None:
        """Write this rank's record to the store now."""
        with self._lock:
            while self._dropped:
                key, seq = self._dropped.popleft()
                self._groups[key]["open"].pop(seq, None)
            version = self._version
            data = json.dumps({"t": time.time(), "closed": self._closed, "groups": self._groups})
        with self._io:
            self._store.set(str(self.rank), data)
        self._published = version

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            if self._dropped or self._version != self._published:
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
        """Which of ``members`` had entered collective ``seq`` of group ``key`` and what each of
        the others was doing (``seq=None``: what each member was doing), as text.

        Publishes this rank's record, waits 1.5 periods (the others' threads publish any change
        older than that), then reads the records; a rank that changed since is counted as
        it was. Never raises: a store that cannot be read is said so in the text.
        """
        try:
            self.publish()
            time.sleep(1.5 * self.period + 0.05)
            records = self.read([r for r in members if r != self.rank])
        except RuntimeError as exc:
            return f"the other ranks' progress records could not be read ({exc})"
        now = time.time()
        others = [r for r in members if r != self.rank]
        if seq is None:
            return "; ".join(f"rank {r}: {_activity(records[r], now)}" for r in others)
        arrived = sorted([self.rank] + [r for r in others if _entered(records[r], key) >= seq])
        missing = [r for r in others if r not in arrived]
        if not missing:
            return (f"every member had entered it (ranks {arrived}): a member is slow inside "
                    f"it, or a network failure")
        why = "; ".join(f"rank {r}: {_reached(records[r], key)}, {_activity(records[r], now)}"
                        for r in missing)
        return f"rank(s) {missing} did not arrive ({why}); arrived: {arrived}"


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
    asynchronously and has not waited for yet."""
    if record is None:
        return ("no progress record (its communicator was never created, or cannot reach the "
                "store)")
    groups, inside, started = record["groups"], [], []
    for k, g in groups.items():
        for seq, (kind, at, waiting) in sorted(g["open"].items(), key=lambda kv: int(kv[0])):
            if waiting:
                inside.append(f"inside {kind}{_where(k)} (#{seq}) for {now - at:.1f} s")
            else:
                started.append(f"{kind}{_where(k)} (#{seq}) started {now - at:.1f} s ago, "
                               f"not waited for yet")
    parts = [", ".join(inside) if inside else _idle(record, now)] + started
    if record["closed"]:
        parts.append("its communicator is closed (its function returned or failed)")
    return "; ".join(parts)


def _idle(record: dict, now: float) -> str:
    """What a rank waiting in no collective was doing: since when, after which collective."""
    done = [(g["last"], k) for k, g in record["groups"].items() if g["last"]]
    if done:
        (seq, kind, at), k = max(done, key=lambda lk: lk[0][2])
        return (f"in no collective for {now - at:.1f} s (its last: {kind}{_where(k)} #{seq}): "
                f"busy outside sbpflow's collectives, or calling different ones")
    if record["groups"]:
        return "in no collective (none finished yet): busy outside sbpflow's collectives"
    return f"no collective yet, {now - record['t']:.1f} s after its communicator was made"
