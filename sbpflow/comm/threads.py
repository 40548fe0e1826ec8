"""In-process backend: one thread a rank, rendezvous through shared memory.

A collective is a *slot* keyed by (group, sequence number): each member deposits its input and
a signature, computes its own result by reading the others' inputs, and returns once every
member has finished reading. The members' signatures must agree (else every member raises the
same `CommError`), and nothing hangs: waits raise `CommAborted`, `CommError` (a missing rank
returned, or a cycle of waits) or `CommTimeout`. The cycle check follows a rank's one waiting
thread; threads that wait beside it (`waits_alongside`) end by abort or timeout.
See docs/internals.md, 'The threads backend'.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import defaultdict, deque
from typing import Callable

import torch

from ..errors import CommAborted, CommError, CommTimeout
from .base import Communicator, collective_stream, default_timeout, reduce_tensors
from .channels import ThreadChannels, copy_tensors
from .progress import Activity, Finding, awaiting, blame

__all__ = ["ThreadWorld", "ThreadCommunicator", "ExitHooks", "default_timeout"]

_POLL = 0.05
What = Callable[[], str]  # describes a call, lazily: formatting costs more than the rendezvous


class _Slot:
    __slots__ = ("data", "sigs", "done", "verdict")

    def __init__(self) -> None:
        self.data: dict[int, object] = {}
        self.sigs: dict[int, tuple] = {}
        self.done = 0
        self.verdict: str | None = None  # set by the last member to arrive: why they disagree


def _call_text(kind: str, group: tuple, seq: int) -> str:
    return f"{kind} over ranks {list(group)} (call #{seq} on this group)"


def _at(ident: int | None) -> str:
    """`` (it is at f (file:line) <- ...)``: where thread ``ident`` is (`_where`), or ``""``."""
    where = _where(ident)
    return f" (it is{where})" if where else ""


def _where(ident: int | None, depth: int = 3) -> str:
    """`` at f (file:line) <- g (file:line)``: the innermost frames of thread ``ident``, less
    the thread's and the launcher's own frames."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return ""
    stack = traceback.extract_stack(frame)
    launcher = os.path.join(os.path.dirname(__file__), "world.py")
    outer = [i for i, fs in enumerate(stack) if fs.filename == launcher]
    stack = stack[outer[-1] + 1 if outer else 0:][-depth:]  # from the launched function in
    return " at " + " <- ".join(f"{fs.name} ({fs.filename}:{fs.lineno})"
                                for fs in reversed(stack))


# -- agreement of the members of one collective ----------------------------------------------
# A signature is ``(head, own)``: ``head`` must be equal on every member (kind first, then what
# the kind's contract needs to agree: op, src, dtype, shapes); ``own`` is what a member passes
# that others declared they expect (checked by the kind's cross check, `_CROSS`).

def _dt(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dts(dtypes: set) -> str:
    return "/".join(sorted(_dt(d) for d in dtypes))


def _shapes(shapes) -> str:
    return "[" + ", ".join(str(tuple(s)) for s in shapes) + "]"


def _describe(head: tuple, own) -> str:
    """A member's call as it asked for it, e.g. ``all_reduce(op=sum, float32, shape (3,))``."""
    kind = head[0]
    if kind == "all_reduce":
        return f"all_reduce(op={head[1]}, {_dt(head[2])}, shape {tuple(head[3])})"
    if kind == "reduce_scatter":
        return f"reduce_scatter(op={head[1]}, {_dts(head[2])}, piece shapes {_shapes(head[3])})"
    if kind == "broadcast":
        return f"broadcast(src={head[1]}, {_dt(head[2])}, shape {tuple(head[3])})"
    if kind == "all_gather":
        return f"all_gather({_dt(head[1])}, shape {tuple(own)}, expecting {_shapes(head[2])})"
    if kind == "all_to_all":
        return (f"all_to_all({_dts(head[1])}, sending {_shapes(own[0])}, "
                f"expecting {_shapes(own[1])})")
    return f"{kind}()"


def _ranks(rs: list[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def _gather_cross(group: tuple, sigs: dict) -> list[str]:
    """Member j's tensor has the shape every member declared for piece j."""
    declared = sigs[group[0]][0][2]
    passed = [sigs[r][1] for r in group]
    if passed == declared:  # one list comparison, in C, on the fast path
        return []
    return [f"every rank expects shape {tuple(want)} from rank {r}, which passes {tuple(got)}"
            for r, want, got in zip(group, declared, passed) if got != want]


def _a2a_cross(group: tuple, sigs: dict) -> list[str]:
    """The piece j sends to i has the shape i declared it expects from j."""
    sends = [sigs[r][1][0] for r in group]  # sends[j][i]: the piece j sends to i
    expected = [list(col) for col in zip(*(sigs[r][1][1] for r in group))]  # [j][i]: i from j
    if sends == expected:  # list comparisons, in C, on the fast path
        return []
    return [f"rank {ri} expects shape {tuple(expected[j][i])} from rank {rj}, which sends "
            f"{tuple(sends[j][i])}" for i, ri in enumerate(group) for j, rj in enumerate(group)
            if sends[j][i] != expected[j][i]]


def _rs_cross(group: tuple, sigs: dict) -> list[str]:
    """One piece a member (the heads agree, so every rank passes as many)."""
    n = len(sigs[group[0]][0][3])
    return [] if n == len(group) else \
        [f"every rank passes {n} pieces to a group of {len(group)} (one a member)"]


_CROSS = {"all_gather": _gather_cross, "all_to_all": _a2a_cross, "reduce_scatter": _rs_cross}


def _disagreement(group: tuple, seq: int, sigs: dict) -> str | None:
    """None if the members' signatures agree; else the message every member raises."""
    head = sigs[group[0]][0]
    for r in group:  # a plain loop: cheaper than all() over a generator on this hot path
        if sigs[r][0] != head:
            problems = _by_call(group, sigs)
            break
    else:
        cross = _CROSS.get(head[0])
        problems = cross(group, sigs) if cross is not None else None
        if not problems:
            return None
        problems = problems[:8] + ([f"and {len(problems) - 8} more"] if len(problems) > 8 else [])
    kinds = {sigs[r][0][0] for r in group}
    kind = kinds.pop() if len(kinds) == 1 else "collective"
    return (f"{_call_text(kind, group, seq)}: the ranks disagree: {'; '.join(problems)}. Every "
            f"rank must issue the same collectives in the same order, with the same op, dtype "
            f"and shapes")


def _by_call(group: tuple, sigs: dict) -> list[str]:
    """``ranks [0, 2] called X``, one entry a distinct call, in group order."""
    by: dict[str, list[int]] = {}
    for r in group:
        by.setdefault(_describe(*sigs[r]), []).append(r)
    return [f"{_ranks(rs)} called {d}" for d, rs in by.items()]


class _ThreadFlags(threading.local):
    alongside = False


_flags = _ThreadFlags()


def waits_alongside(on: bool) -> None:
    """Mark the calling thread's waits as running beside other waiting threads of its rank (an
    actor runtime's recv and compute threads, a ZeRO worker beside its owner). Deadlock
    detection assumes one waiting thread a rank, so it leaves these waits out; they still end
    by abort or timeout."""
    _flags.alongside = on


class ThreadWorld:
    """Shared state of the ranks of one in-process run.

    ``blocked[rank]`` lists the waits the rank's threads are in, as ``(what, missing)``:
    what the call is and which ranks it still needs (computed live, under ``cond``).
    ``alongside[rank]`` lists the waits of its `waits_alongside` threads, as ``(thread name,
    what, missing)``: error messages name them, the cycle check never reads them.
    """

    def __init__(self, world_size: int, timeout: float | None = None) -> None:
        self.world_size = world_size
        self.timeout = default_timeout() if timeout is None else timeout
        self.cond = threading.Condition()
        self.slots: dict[tuple, _Slot] = {}
        # (src, dst, collective stream): a stream's messages pair only with its own receives
        self.mailboxes: dict[tuple[int, int, str | None], deque] = defaultdict(deque)
        # (rank, "Class: message") of the first failure: the text, not the exception, whose
        # traceback holds the rank frames that hold this world (a cycle only gc would free)
        self.failure: tuple[int, str] | None = None
        self.failed_at: float | None = None  # time.monotonic() of the first failure
        self.finished: set[int] = set()
        self.blocked: dict[int, list[tuple[What, Callable[[], list[int]]]]] = {}
        self.alongside: dict[int, list[tuple[str, What, Callable[[], list[int]]]]] = {}
        self.verdicts: dict[int, str] = {}  # a rank's wait must raise CommError(this)
        # rank -> (count, reason): waits that began before the count grew raise CommAborted
        self.interrupts: dict[int, tuple[int, str]] = {}
        self.idents: dict[int, int] = {}  # rank -> thread id, to say where a stuck rank is
        self.activities: dict[int, Activity] = {}  # rank -> what its actor threads are inside
        self.channels = ThreadChannels()  # Communicator.post / inbox

    def interrupt_count(self, rank: int) -> int:
        """How many times ``rank`` was interrupted (`ThreadCommunicator.interrupt`)."""
        return self.interrupts.get(rank, (0, ""))[0]

    def check_epoch(self, rank: int, epoch: int, what: What) -> None:
        """Raise `CommAborted` if ``rank`` was interrupted since ``epoch`` (its count then)."""
        count, reason = self.interrupts.get(rank, (0, ""))
        if count != epoch:
            raise CommAborted(f"{what()} on rank {rank} abandoned: {reason}")

    def abort(self, rank: int, exc: BaseException) -> None:
        """Record the first failure (``rank`` -1: the caller of launch) and wake every wait."""
        with self.cond:
            if self.failure is None:
                self.failure = (rank, f"{type(exc).__name__}: {exc}")
                self.failed_at = time.monotonic()
            self.cond.notify_all()

    def finish(self, rank: int) -> None:
        """Mark ``rank``'s function as ended (a collective waiting for it then fails at once
        instead of timing out)."""
        with self.cond:
            self.finished.add(rank)
            self.cond.notify_all()

    def check_alive(self, rank: int, what: What) -> None:
        """Raise `CommAborted` if another rank failed: a call in an aborted world (say by a rank
        that was stuck in its own code when the run ended) must not wait."""
        if self.failure is not None and self.failure[0] != rank:
            r, text = self.failure
            who = f"rank {r}" if r >= 0 else "the caller of launch"
            raise CommAborted(f"{what()} on rank {rank} abandoned: {who} failed with {text}")

    def wait_ranks(self, grace: float) -> None:
        """Return when every rank has finished, or ``grace`` seconds after the first failure."""
        with self.cond:
            while len(self.finished) < self.world_size:
                if self.failed_at is None:
                    self.cond.wait(1.0)
                    continue
                left = self.failed_at + grace - time.monotonic()
                if left <= 0:
                    return
                self.cond.wait(left)

    def describe(self, rank: int) -> str:
        """What ``rank`` is doing, for error messages: each of its threads inside an actor's
        function and waiting for no other rank (first: the likely culprit), with where it is;
        each wait of its threads (its own and those that wait alongside it, by thread name,
        with the actor they are inside) with the ranks it still needs; else its actor run
        waiting for messages, or where its own thread is. Call with ``cond`` held."""
        if rank in self.finished:
            return f"rank {rank} has returned from the launched function"
        inside, runs = self._inside(rank)
        waits = [f"rank {rank} waits in {what()} for rank(s) {missing()}"
                 for what, missing in self.blocked.get(rank, ())]
        # a rank whose own thread computes may still wait on its actor or worker threads
        for name, what, missing in self.alongside.get(rank, ()):
            actor = inside.pop(name, None)
            within = f" (inside {actor[0]})" if actor else ""
            waits.append(f"rank {rank}'s thread {name!r}{within} waits in {what()} for "
                         f"rank(s) {missing()}")
        busy = [f"rank {rank}'s thread {name!r} is inside {text}, not waiting for another "
                f"rank" + _at(ident) for name, (text, ident, _) in inside.items()]
        if busy or waits:
            return "; ".join(busy + waits)
        if runs:
            return f"rank {rank} is in {', '.join(runs)}, no actor inside its function"
        activity = self.activities.get(rank)  # (not in a run here: an eager op)
        op = activity.op if activity is not None else None
        return f"rank {rank} is not waiting for another rank" + _at(self.idents.get(rank)) + \
            (f"; the last sbpflow op it started: {op!r}" if op is not None else "")

    def _inside(self, rank: int) -> tuple[dict[str, tuple[str, int | None, float]], list[str]]:
        """``rank``'s threads inside an actor's function, by name: (what, thread id, seconds
        inside), from its `Activity`; and its actor runs in progress, with whom they wait for."""
        activity = self.activities.get(rank)
        if activity is None:
            return {}, []
        snap, now, inside = activity.snapshot(threads=True), time.perf_counter(), {}
        for label, _since, busy, _peers in snap["runs"]:
            for t, what, mb, at in busy:
                inside[t.name] = (f"{what}, micro-batch {mb}, of {label}, for {now - at:.1f} s",
                                  t.ident, now - at)
        return inside, [f"{label} ({awaiting(peers)})" for label, _, _, peers in snap["runs"]]

    def stuck(self, rank: int, threshold: float) -> bool:
        """Whether ``rank`` waits for no other rank (for ``threshold`` s at least, where its
        `Activity` says since when): it returned, a thread of it is inside an actor's function
        and not waiting, or none of its threads waits and it runs no actors (its own code).
        Call with ``cond`` held."""
        if rank in self.finished:
            return True
        inside, runs = self._inside(rank)
        waiting = {name for name, _, _ in self.alongside.get(rank, ())}
        if any(age >= threshold for name, (_, _, age) in inside.items() if name not in waiting):
            return True
        return not (runs or self.blocked.get(rank) or self.alongside.get(rank))

    def _chain(self, ranks: list[int]) -> list[int]:
        """``ranks`` and, transitively, the ranks their threads wait for (and their actor runs
        for messages), in the order met: a wait for a rank that waits for another ends at the
        one that holds them up."""
        seen = list(ranks)
        for r in seen:  # (grows while read)
            needs = [m for _, missing in self.blocked.get(r, ()) for m in missing()]
            needs += [m for _, _, missing in self.alongside.get(r, ()) for m in missing()]
            activity = self.activities.get(r)
            if activity is not None:  # the ranks its actor runs wait for messages from
                needs += [m for run in activity.snapshot()["runs"] for m in run[3]]
            seen += [m for m in dict.fromkeys(needs) if m not in seen]
        return seen

    def whereabouts(self, ranks: list[int], threshold: float) -> Finding:
        """`Communicator.whereabouts` of this world (call with ``cond`` held)."""
        text = "; ".join(self.describe(r) for r in ranks)
        culprits = tuple(r for r in ranks if self.stuck(r, threshold))
        return Finding(text + (f"; {blame(culprits)}" if culprits else ""), culprits)

    def wait(self, ready: Callable[[], bool], what: What, missing: Callable[[], list[int]],
             rank: int, epoch: int | None = None) -> None:
        """Wait on ``self.cond`` (held by the caller) until ``ready()``; never forever."""
        if ready():
            return
        alone = not _flags.alongside
        if alone:
            entry: tuple = (what, missing)
            waits = self.blocked.setdefault(rank, [])
        else:  # described in messages only: kept out of `_needs` and `_cycle`
            entry = (threading.current_thread().name, what, missing)
            waits = self.alongside.setdefault(rank, [])
        waits.append(entry)
        try:
            start = time.monotonic()
            deadline = start + self.timeout
            while not ready():
                now = time.monotonic()
                self._check(rank, what, missing, deadline - now, alone and now - start >= _POLL)
                if epoch is not None:
                    self.check_epoch(rank, epoch, what)
                self.cond.wait(min(deadline - now, _POLL))
        finally:
            waits.remove(entry)

    def _check(self, rank: int, what: What, missing: Callable[[], list[int]], left: float,
               look_for_cycle: bool) -> None:
        """Raise if the wait of ``rank`` for ``missing()`` can never end."""
        verdict = self.verdicts.pop(rank, None)
        if verdict is not None:
            raise CommError(verdict)
        self.check_alive(rank, what)
        gone = [m for m in missing() if m in self.finished]
        if gone:
            raise CommError(f"{what()} on rank {rank} waits for rank(s) {gone}, which already "
                            f"returned from the launched function without joining it")
        if look_for_cycle:  # not at once: the fast path of a rendezvous stays cheap
            cycle = self._cycle(rank)
            if cycle:
                msg = self._deadlock(cycle)
                for m in self._doomed(cycle):
                    if m != rank:
                        self.verdicts[m] = msg
                self.cond.notify_all()
                raise CommError(msg)
        if left <= 0:
            late = missing()
            chain = self._chain(late)  # and those they wait for: the culprit is at its end
            states = "; ".join(self.describe(m) for m in chain)
            err = CommTimeout(f"{what()} on rank {rank} timed out after {self.timeout:g} s "
                              f"waiting for rank(s) {late} (SBPFLOW_TIMEOUT): {states}")
            err.culprits = tuple(m for m in chain if self.stuck(m, self.timeout / 2)) or \
                tuple(late)
            raise err

    def _needs(self, rank: int) -> list[int]:
        """The ranks ``rank`` waits for; none unless it waits on exactly one thread."""
        waits = self.blocked.get(rank)
        return waits[0][1]() if waits and len(waits) == 1 else []

    def _cycle(self, rank: int) -> list[int]:
        """Ranks ``[rank, a, b, ...]``, each waiting for the next and the last for ``rank``:
        none of them can ever proceed. Empty if there is no such cycle."""
        path, seen = [rank], {rank}

        def visit(r: int) -> bool:
            for m in self._needs(r):
                if m == rank:
                    return True
                if m not in seen:
                    seen.add(m)
                    path.append(m)
                    if visit(m):
                        return True
                    path.pop()
            return False

        return path if visit(rank) else []

    def _doomed(self, cycle: list[int]) -> set[int]:
        """The ranks of ``cycle`` and every waiting rank that needs one of them."""
        doomed, grew = set(cycle), True
        while grew:
            more = {r for r in self.blocked if r not in doomed
                    and any(m in doomed for m in self._needs(r))}
            doomed |= more
            grew = bool(more)
        return doomed

    def _deadlock(self, cycle: list[int]) -> str:
        nxt = cycle[1:] + cycle[:1]
        links = [f"rank {r} waits in {self.blocked[r][0][0]()} for rank {m}"
                 for r, m in zip(cycle, nxt)]
        return (f"deadlock: {', '.join(links)}; the ranks disagree on the groups or the order "
                f"of their calls (every rank must issue the same collectives, over the same "
                f"groups, in the same order)")


class ExitHooks:
    """What to run when a rank's launched function ends, normally or by an exception
    (`sbpflow.comm.at_rank_exit`). A bound method is held weakly (registering keeps its object
    alive no longer than before: a loader dropped mid-rank still closes when it is garbage);
    any other callable strongly. `run` calls each live one once, the last registered first."""

    def __init__(self) -> None:
        self._hooks: list[Callable[[], Callable[[], object] | None]] = []
        self._lock = threading.Lock()

    def add(self, callback: Callable[[], object]) -> None:
        ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") and \
            hasattr(callback, "__func__") else (lambda: callback)
        with self._lock:  # dead ones dropped: a long rank that makes many loaders stays small
            self._hooks = [h for h in self._hooks if h() is not None] + [ref]

    def run(self, rank: int) -> None:
        """Call the hooks (those still alive), emptying the registry. A hook that raises is
        reported as a `RuntimeWarning` naming it and ``rank``; the others still run, and the
        rank's own outcome (its result or exception) stands."""
        with self._lock:
            hooks, self._hooks = self._hooks, []
        for ref in reversed(hooks):
            callback = ref()
            if callback is None:
                continue
            try:
                callback()
            except Exception as exc:  # noqa: BLE001 - must not replace the rank's outcome
                warnings.warn(f"sbpflow launch: rank {rank}'s exit hook {callback!r} raised "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)

    def __len__(self) -> int:
        with self._lock:
            return sum(h() is not None for h in self._hooks)


class ThreadCommunicator(Communicator):
    """One rank of a `ThreadWorld`. Create it on the rank's thread (it records the thread, to
    say where the rank is when others wait for it). ``exit_hooks``: the rank's `ExitHooks`
    when it runs a launched function (`sf.launch`), which runs them when the function ends;
    ``None`` for the process-wide single-rank world, which never ends."""

    backend = "threads"
    interruptible = True

    def __init__(self, world: ThreadWorld, rank: int,
                 exit_hooks: ExitHooks | None = None) -> None:
        super().__init__(rank, world.world_size)
        self.world = world
        self.exit_hooks = exit_hooks
        self._seq: dict[tuple, int] = defaultdict(int)
        self._epochs: dict[str, int] = {}  # named stream -> the interrupt count at first use
        world.idents[rank] = threading.get_ident()
        world.activities[rank] = self.activity

    def wait_timeout(self) -> float:
        return self.world.timeout   # (``sf.launch(..., timeout=)`` sets the world's)

    def whereabouts(self, ranks, threshold):
        with self.world.cond:
            return self.world.whereabouts(sorted(ranks), threshold)

    def _epoch(self, stream: str | None, what: What) -> int | None:
        """The interrupt count a named stream belongs to (that of its first call), after
        checking it is still current: after an `interrupt` the stream's calls and receives are
        abandoned at once (the runtime moves on to a new stream); None for the default stream."""
        if stream is None:
            return None
        epoch = self._epochs.setdefault(stream, self.world.interrupt_count(self.rank))
        self.world.check_epoch(self.rank, epoch, what)
        return epoch

    # -- the rendezvous ------------------------------------------------------------------------
    def _collective(self, kind: str, group: tuple, payload, sig: tuple,
                    compute: Callable[[dict], object]):
        """Deposit ``payload`` and signature ``sig`` (see `_disagreement`), wait for the other
        members, return ``compute(payloads by rank)``."""
        w, rank = self.world, self.rank
        stream = collective_stream()
        series = group if stream is None else (group, stream)  # each stream its own order
        seq = self._seq[series]
        self._seq[series] = seq + 1
        key = (series, seq)
        what = lambda: _call_text(kind, group, seq)  # noqa: E731 - formatted only on errors
        w.check_alive(rank, what)
        epoch = self._epoch(stream, what)
        with w.cond:
            slot = w.slots.get(key)
            if slot is None:
                slot = w.slots[key] = _Slot()
            slot.data[rank] = payload
            slot.sigs[rank] = sig
            if len(slot.data) == len(group):  # the last to arrive judges for everyone
                slot.verdict = _disagreement(group, seq, slot.sigs)
                w.cond.notify_all()
            else:
                try:  # a named stream's wait may be interrupted (`interrupt`): its series is
                    # renamed after the failure, so nobody pairs with it; take the input back
                    w.wait(lambda: len(slot.data) == len(group), what,
                           lambda: [r for r in group if r not in slot.data], rank, epoch)
                except CommAborted:
                    if len(slot.data) < len(group):
                        slot.data.pop(rank, None)
                        slot.sigs.pop(rank, None)
                        if not slot.data:
                            w.slots.pop(key, None)
                    raise
        try:
            if slot.verdict is not None:
                raise CommError(slot.verdict)
            return compute(slot.data)
        finally:
            self._leave(slot, key, len(group), what)

    def _leave(self, slot: _Slot, key: tuple, n: int, what: What) -> None:
        """Count this member out of ``slot``; the last one removes it. Others may still be
        reading our input (unless the call failed its agreement): stay until they are done."""
        w = self.world
        with w.cond:
            slot.done += 1
            if slot.done == n:
                w.slots.pop(key, None)
                w.cond.notify_all()
            elif slot.verdict is None:
                w.wait(lambda: slot.done == n, lambda: what() + " (finishing)", lambda: [],
                       self.rank)

    def _all_gather(self, tensor, group, shapes, assemble, joined=None):
        # (``joined`` unused: the pieces are the other ranks' own tensors, copied once by
        # ``assemble``)
        return self._collective("all_gather", group, tensor,
                                (("all_gather", tensor.dtype, shapes), tensor.shape),
                                lambda d: assemble([d[r] for r in group]))

    def _all_to_all(self, pieces, group, shapes, assemble, joined=None):
        i = group.index(self.rank)
        dtypes = {p.dtype for p in pieces}
        sig = (("all_to_all", dtypes), ([p.shape for p in pieces], shapes))
        return self._collective("all_to_all", group, pieces, sig,
                                lambda d: assemble([d[r][i] for r in group]))

    def _reduce_scatter(self, pieces, group, op):
        i = group.index(self.rank)
        dtypes = {p.dtype for p in pieces}
        sig = (("reduce_scatter", op, dtypes, [p.shape for p in pieces]), None)
        return self._collective("reduce_scatter", group, pieces, sig,
                                lambda d: reduce_tensors([d[r][i] for r in group], op))

    def _all_reduce(self, tensor, group, op):
        return self._collective("all_reduce", group, tensor,
                                (("all_reduce", op, tensor.dtype, tensor.shape), None),
                                lambda d: reduce_tensors([d[r] for r in group], op))

    def _broadcast(self, tensor, src, group):
        payload = tensor if self.rank == src else None
        return self._collective("broadcast", group, payload,
                                (("broadcast", src, tensor.dtype, tensor.shape), None),
                                lambda d: d[src].clone())

    def _barrier(self, group):
        self._collective("barrier", group, None, (("barrier",), None), lambda d: None)

    def _exchange(self, sends, recvs):
        w, stream = self.world, collective_stream()
        w.check_alive(self.rank, lambda: "point-to-point exchange")
        with w.cond:
            for dst, t in sends:
                # Copy on send: the sender may change its tensor as soon as we return.
                w.mailboxes[(self.rank, dst, stream)].append(t.detach().clone())
            if sends:
                w.cond.notify_all()
        return [self._recv(src, shape, dtype, device, stream)
                for src, shape, dtype, device in recvs]

    def _recv(self, src: int, shape: tuple, dtype: torch.dtype, device: torch.device,
              stream: str | None):
        w = self.world
        box = w.mailboxes[(src, self.rank, stream)]
        what = lambda: f"recv from rank {src}"  # noqa: E731
        epoch = self._epoch(stream, what)  # a failed run's receive gives up at `interrupt`
        with w.cond:
            w.wait(lambda: len(box) > 0, what, lambda: [] if box else [src], self.rank, epoch)
            t = box.popleft()
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CommError(f"recv on rank {self.rank} from rank {src}: the ranks disagree: "
                            f"rank {self.rank} expects a {_dt(dtype)} tensor of shape {shape}, "
                            f"rank {src} sent a {_dt(t.dtype)} tensor of shape "
                            f"{tuple(t.shape)}; sends and recvs between a pair must match "
                            f"in order, dtype and shape")
        return t.to(device)

    def interrupt(self, reason: str) -> None:
        w = self.world
        with w.cond:
            w.interrupts[self.rank] = (w.interrupt_count(self.rank) + 1, reason)
            w.cond.notify_all()

    def _post(self, dst, channel, message):
        # never raises for an aborted world: a post does not wait, and the runtime's own abort
        # messages must still reach the ranks that have not seen the failure
        self.world.channels.post(self.rank, dst, channel, copy_tensors(message))

    def _inbox(self, channel, timeout):
        return self.world.channels.take(
            self.rank, channel, timeout,
            lambda: self.world.check_alive(self.rank, lambda: f"inbox of channel {channel!r}"))

    def device(self, device_type: str) -> torch.device:
        if device_type == "cpu":
            return torch.device("cpu")
        n = torch.cuda.device_count()
        if self.world_size > n:
            raise CommError(
                f"the threads backend needs one GPU per rank: world size {self.world_size} but "
                f"{n} cuda device(s); several ranks on one GPU would deadlock autograd. Use fewer "
                f"ranks, cpu placements, or backend='torch'")
        return torch.device("cuda", self.rank)
