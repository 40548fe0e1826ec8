"""What one rank of a CDP trainer holds between runs, and the functions its actors run.

The values of the schedule (activations, their gradients, gradient sums) live in ``values``
until their one reader takes them; versions and ZeRO's relayed copies in the `VersionStore`;
each in-flight micro-batch's autograd state in ``stash`` (F_j to B_j). After each task that
adds parameter bytes, in a run that measures (`window_measure`), the bytes the rank holds are
measured (``param_peak``). An actor's task is stored relative to its run (`program.shift`),
so one plan serves every run of the same shape; ``ctx`` is the current run's (first cycle,
first step). An activation or its gradient
travels in the runtime's message (`fused_op`, `deliver`); parameters and gradient sums over the
Communicator's point-to-point in a stream of the trainer's own (`send`, `recv`). See
docs/cdp.md, 'How it runs'.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from ... import memory
from ...comm import current, set_collective_stream
from ...placement import Placement
from .program import PARAMS, PeerTransfer, Work, refetched, relay_reads, shift
from .roles import Roles
from .rules import accumulate, fresh, version_read
from .stage_runner import StageRunner
from .version_store import StageOwner, VersionStore, owns_storage

__all__ = ["RankState"]

_ANCHOR = torch.zeros((), requires_grad=True)  # makes a stage's input a non-leaf (see _StageEntry)


class _StageEntry(torch.autograd.Function):
    """A stage's input as a view of the received tensor that requires grad: autograd gives
    its gradient, and it is not a leaf, so ``sf.memory.track`` counts what autograd saves of
    it (no copy is made, and the received tensor is not kept a second time)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class RankState:
    """Rank ``rank``'s part of a trainer of ``n`` stages (``runners``) under ``rule``.
    ``shapes(cycle, worker, stage)`` gives an activation's shape and dtype; ``stream()`` the
    collective stream of the trainer's transfers."""

    def __init__(self, rank: int, n: int, rule: str, roles: Roles,
                 runners: Sequence[StageRunner], loss_fn: Callable, pl: Placement,
                 store: VersionStore, shapes: Callable, stream: Callable[[], str]) -> None:
        self.rank, self.n, self.rule, self.runners = rank, n, rule, list(runners)
        self.roles = roles
        self.param_peak = 0  # the most parameter bytes held after a task (`param_bytes`)
        # ZeRO: the stages whose versions this rank gets relayed a use (not its own)
        self.relayed_stages = {j for j in range(n) if roles.mode == "zero"
                               and rank != roles.owner(j)}
        # per stage: whether its relayed copy is freed after F and relayed again for B
        self.refetch = [refetched(roles, n, rank, j) for j in range(n)]
        # per (worker, stage): whether it reads its own cycle's version (`rules.fresh`, read
        # at every forward)
        self.fresh = [[fresh(rule, i, j, n) for j in range(n)] for i in range(n)]
        self.loss_fn, self.pl, self.store = loss_fn, pl, store
        self.shapes, self.stream = shapes, stream
        self.owners: dict[int, StageOwner] = {}
        self.values: dict[tuple, object] = {}
        self.stash: dict[tuple, tuple] = {}
        self.batches: dict[int, tuple[list, list]] = {}   # cycle -> (xs, ys) micro-batches
        # (cycle, worker, the loss as a 0-d tensor): read as floats once the call's runs ended
        # (on cuda a read waits for the device: not once a micro-batch)
        self.losses: list[tuple[int, int, torch.Tensor]] = []
        self.ctx = (0, 0)  # the run's (first cycle, first step)
        self.messages = self.nbytes = 0
        self.count_lock = threading.Lock()  # each peer's send runs on a thread of its own
        self.log: dict[str, tuple] = {}  # actor name -> (its task, version) of this run
        # (the task as the plan holds it, relative to ``ctx``: `program.shift` moves it)
        self.failed: Work | PeerTransfer | None = None  # the run's first task that raised here
        # whether this run measures what the rank holds, and whether each of its forwards
        # replayed fixed kernels (`window_measure`); the trainer's tracker
        self.measure, self.replayed_all = True, True
        # with peers, the times versions and relayed copies arrive vary from run to run, and so
        # the parameter bytes held: sampled in every run (the F / B order is the plan's)
        self.sample_always = len(roles.ranks) > 1
        self.tracker: memory.Tracker | None = None
        # stash key -> the storages `adopt_live` counted in the tracker for it
        self.adopted: dict[tuple, list] = {}

    def task(self, rel: Work | PeerTransfer) -> Work | PeerTransfer:
        return shift(rel, *self.ctx)

    def _relayed(self, stage: int) -> bool:
        return stage in self.relayed_stages

    def param_bytes(self) -> int:
        """Bytes of the parameter tensors and optimizer state this rank holds now: versions,
        relayed copies, those in-flight micro-batches keep, the owned stages' optimizer
        state; each storage once (a freed one counts 0)."""
        tensors = self.store.tensors()
        tensors += [p for e in list(self.stash.values()) for p in e[1]]
        for owner in list(self.owners.values()):
            tensors += owner.tensors()
        seen: dict[int, int] = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes():
                seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    def sample(self) -> None:
        """Measure `param_bytes` into ``param_peak``: after each task that adds parameter
        bytes (a version received or made, a copy refilled; others only free them), in a
        run that measures (``measure``, `window_measure`), or in every run with peers."""
        if not (self.measure or self.sample_always):
            return
        held = self.param_bytes()
        with self.count_lock:
            self.param_peak = max(self.param_peak, held)

    def _eager(self):
        """The block a forward that does not replay fixed kernels runs in, in a run that
        does not measure: measured on its own, and every run measured again after
        (`WindowMeasure.ended`)."""
        self.replayed_all = False
        return memory.attach([self.tracker])

    def adopt_live(self) -> None:
        """Count in the tracker what autograd keeps of the forwards in flight that ran in a
        run that did not measure (their graphs' saved tensors, each storage once, the
        parameters' own not), until their backward: a measured run after it then starts
        from what a run measured throughout would hold."""
        for key, (_, params, out, _, _) in list(self.stash.items()):
            if key in self.adopted:
                continue
            own = {memory.storage_key(p) for p in params}
            held = {found for found in map(memory.storage_key, memory.saved_tensors(out))
                    if found is not None and found not in own}
            for k, nbytes in held:
                self.tracker.hold(k, nbytes, "saved")
            self.adopted[key] = [k for k, _ in held]

    # -- compute --------------------------------------------------------------------------------
    def forward(self, rel: Work, name: str) -> None:
        i, j, c = rel.worker, rel.stage, rel.cycle + self.ctx[0]
        v = version_read(self.fresh[i][j], c)
        relay = (("param", j, v), c) if self._relayed(j) else None
        if relay:
            params = self.store.relay(relay)
        else:
            params = self.store.take(j, v)
        if not self.refetch[j]:
            self.store.hold(j, v)
        xs, ys = self.batches[c]
        if j == 0:
            x_in = xs[i]
        elif self.measure:
            x_in = _StageEntry.apply(self.values.pop(("act", i, c, j - 1)), _ANCHOR)
        else:  # (a leaf: nothing counts it; the same values and gradients)
            x_in = self.values.pop(("act", i, c, j - 1)).requires_grad_()
        last = j == self.n - 1
        out, changes = self.runners[j].forward(params, x_in, self.pl,
                                               self.loss_fn if last else None,
                                               ys[i] if last else None,
                                               eager=None if self.measure else self._eager)
        self.stash[(i, c, j)] = (x_in if j else None, params, out, v, changes)
        if relay:
            self.store.done_relay(relay)  # a refetched copy's storage goes now
        if last:
            self.losses.append((c, i, out.detach()))
        else:
            self.values[("act", i, c, j)] = out.detach()
        self.log[name] = (rel, v)

    def backward(self, rel: Work, name: str) -> None:
        i, j, c = rel.worker, rel.stage, rel.cycle + self.ctx[0]
        x_in, params, out, v, changes = self.stash.pop((i, c, j))
        refetch = self.refetch[j]
        if refetch:  # ZeRO: the copy relayed again for this backward fills the stashed tensors
            relay = (("paramb", j, v), c)
            self.store.refill(relay, params)
        grad = None if j == self.n - 1 else self.values.pop(("gact", i, c, j + 1))
        inputs = ([x_in] if j else []) + list(params[:self.runners[j].nparams])
        grads = StageRunner.backward(out, grad, inputs) + changes
        del out, x_in, params  # the micro-batch's activations of this stage go now
        for k in self.adopted.pop((i, c, j), ()):
            self.tracker.release(k)
        if refetch:
            self.store.done_relay(relay)
            self.sample()
        else:
            self.store.drop(j, v)
        if j:
            self.values[("gact", i, c, j)] = grads[0]
        self.values[("g", i, c, j)] = grads[1:] if j else grads
        self.log[name] = (rel, v)

    def accumulate(self, rel: Work, name: str) -> None:
        i, j, c = rel.worker, rel.stage, rel.cycle + self.ctx[0]
        g = self.values.pop(("g", i, c, j))
        partial = self.values.pop(("gsum", i - 1, c, j)) if i else None
        # (from worker 2 on, the partial sum is one this rank or a peer made with ``+``)
        self.values[("gsum", i, c, j)] = accumulate(partial, g, into=i >= 2)
        self.log[name] = (rel, -1)

    def update(self, rel: Work, name: str) -> None:
        j, c = rel.stage, rel.cycle + self.ctx[0]
        total = self.values.pop(("gsum", self.n - 1, c, j))
        latest = self.store.take(j, c)
        self.store.put(j, c + 1, self.owners[j].step(latest, total,
                                                     in_place=self.store.unused(j, c)))
        self.sample()
        self.log[name] = (rel, c + 1)

    # -- transfers ------------------------------------------------------------------------------
    def _tensors(self, t: PeerTransfer) -> list[torch.Tensor]:
        kind = t.payload[0]
        if kind in PARAMS and self._relayed(t.payload[1]):
            return [p.detach() for p in self.store.relay((t.payload, t.cycle))]
        if kind in PARAMS:  # (a send's read: over at `_sent`)
            return [p.detach() for p in self.store.take(t.payload[1], t.payload[2],
                                                          sending=True)]
        value = self.values.pop(t.payload)
        return list(value) if kind == "gsum" else [value]

    def _meta(self, t: PeerTransfer) -> list[tuple]:
        kind, a, b, *rest = t.payload
        if kind in PARAMS + ("gsum",):
            r = self.runners[a if kind in PARAMS else rest[0]]
            return list(zip(r.shapes, r.dtypes))
        i, c, j = a, b, rest[0]
        return [self.shapes(c, i, j if kind == "act" else j - 1)]

    def send(self, rel: PeerTransfer, name: str) -> None:
        t = self.task(rel)
        tensors = self._tensors(t)
        previous = set_collective_stream(self.stream())
        try:
            current().exchange([(t.dst, x.contiguous()) for x in tensors], [])
        finally:
            set_collective_stream(previous)
        self._count(tensors)
        del tensors
        self._sent(t)
        self.log[name] = (rel, -1)

    def _sent(self, t: PeerTransfer) -> None:
        """A send's read of a version or relayed copy is over: the exchange copied it. Not
        before: an update on the compute thread writes into a version none reads any more
        (`VersionStore.unused`), and the receiver must get the version as it was."""
        kind = t.payload[0]
        if kind in PARAMS and self._relayed(t.payload[1]):
            self.store.done_relay((t.payload, t.cycle))
        elif kind in PARAMS:
            self.store.sent(t.payload[1], t.payload[2])

    def _count(self, tensors) -> None:
        """One message of ``tensors`` sent by this rank (``stats()``'s messages and bytes)."""
        with self.count_lock:
            self.messages += 1
            self.nbytes += sum(x.numel() * x.element_size() for x in tensors)

    def recv(self, rel: PeerTransfer, name: str) -> None:
        t = self.task(rel)
        comm = current()
        device = comm.device(self.pl.device_type)
        previous = set_collective_stream(self.stream())
        try:
            got = comm.exchange([], [(t.src, s, d, device) for s, d in self._meta(t)])
        finally:
            set_collective_stream(previous)
        kind = t.payload[0]
        if kind in PARAMS and self._relayed(t.payload[1]):
            j = t.payload[1]
            reads = relay_reads(self.n, self.rule, self.roles, self.rank, kind, j, t.cycle)
            free = kind == "param" and self.refetch[j]
            got = self.runners[j].version(got) if kind == "param" else got
            self.store.put_relay((t.payload, t.cycle), got, reads, free)
        elif kind == "param":
            self.store.put(t.payload[1], t.payload[2],
                           self.runners[t.payload[1]].version(got))
        else:
            self.values[t.payload] = got if kind == "gsum" else got[0]
        if kind in PARAMS:
            self.sample()
        self.log[name] = (rel, -1)

    def deliver(self, rel: PeerTransfer, name: str, value: torch.Tensor) -> None:
        """A direct transfer's receive: ``value`` came in the send's message."""
        t = self.task(rel)
        self.values[t.payload] = value
        self.log[name] = (rel, -1)

    def fused_op(self, fn: Callable, t_in: PeerTransfer | None, t_out: PeerTransfer | None,
                 rel: Work, name: str, *values) -> torch.Tensor | None:
        """Op ``fn`` of task ``rel`` with its fused direct transfers: the value of ``t_in``
        (its first input value) goes into ``values``, the op runs, the value of ``t_out`` is
        returned to travel in the runtime's message to its consumer (or to `deliver`), counted
        as `send` counts."""
        if t_in is not None:
            self.values[self.task(t_in).payload] = values[0]
        fn(rel, name)
        if t_out is None:
            return None
        value = self.values.pop(self.task(t_out).payload)
        # a view would carry its whole storage (messages pickle storages)
        value = value if owns_storage(value) else value.contiguous().clone()
        self._count([value])
        return value

    def actor_fn(self, fn: Callable, rel: Work | PeerTransfer, name: str, tokens: bool = False
                 ) -> Callable:
        """The runtime's function for the actor ``name`` of task ``rel``: ``fn(rel, name)``,
        with ``tokens`` ``fn(rel, name, *input values)`` (the firing index is not needed)."""
        def run(_mb: int, *values):
            try:
                return fn(rel, name, *values) if tokens else fn(rel, name)
            except BaseException:
                if self.failed is None:  # the absolute task: actor names are run-relative
                    self.failed = self.task(rel)
                raise
        return run

