"""The parameter versions one rank holds, and the optimizer of each stage it owns.

`VersionStore` keeps ``(stage, version) -> tensors`` with a count of the tasks of the rank
that still read them (its forwards, its sends, the owner's update); the copy goes when the
count reaches 0. ZeRO's relayed copies are kept per delivery (`put_relay`); one fetched
again for the backward has its storage freed after its last read (autograd's saved tensors
share it) and refilled by `refill`. In-flight micro-batches keep their version alive
through autograd (the stash from F_j to B_j); `hold` / `drop` count them, so `max_versions`
is the most distinct versions of a stage alive at once on the rank. `StageOwner` runs a
stage's optimizer: each update starts from a copy of the latest version (in-flight
micro-batches keep theirs; none left to read it: the version itself) and its result is the
next version. See docs/cdp.md, 'Rules and versions'.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from ...errors import PlanError
from ...nn.parameter import Parameter
from ...placement import Placement
from ...sbp import B
from ...tensor import GlobalTensor
from .rules import advance, average

__all__ = ["VersionStore", "StageOwner", "owns_storage"]


class VersionStore:
    """Versions on one rank; ``uses(stage, version)`` says how many reads a new copy gets."""

    def __init__(self, n: int, uses: Callable[[int, int], int]) -> None:
        self.uses = uses
        self.lock = threading.Lock()  # receive threads put while the compute thread reads
        self.entries: dict[tuple[int, int], list] = {}   # -> [tensors, reads left]
        self.held: list[dict[int, int]] = [{} for _ in range(n)]  # stage -> version -> mbs
        self.relays: dict[tuple, list] = {}  # ((label, stage, version), cycle) -> [tensors,
        #                                       reads left, free the storage after the last]
        self.max_versions = [0] * n
        self.sending: dict[tuple[int, int], int] = {}  # (stage, version) -> sends copying it

    def _note(self, stage: int) -> None:
        live = {v for (s, v) in self.entries if s == stage} | set(self.held[stage])
        live |= {p[2] for p, _ in self.relays if p[1] == stage}
        self.max_versions[stage] = max(self.max_versions[stage], len(live))

    # -- ZeRO's relayed copies ------------------------------------------------------------------
    def put_relay(self, key: tuple, tensors: Sequence[torch.Tensor], reads: int,
                  free: bool) -> None:
        """A copy relayed for one op (``key``: ``(payload, cycle)``), read ``reads`` times
        (the op, the send to the next worker); with ``free``, its storage is released after
        the last read (each tensor gets a storage of its own here, so that frees only it)."""
        own = [t if owns_storage(t) else t.clone() for t in tensors]
        with self.lock:
            self.relays[key] = [own, reads, free]
            self._note(key[0][1])

    def relay(self, key: tuple) -> list[torch.Tensor]:
        """The tensors of a relayed copy (`done_relay` counts the read once used)."""
        with self.lock:
            return self.relays[key][0]

    def done_relay(self, key: tuple) -> None:
        """One read of a relayed copy is over: after the last the copy goes (its storage
        freed if it was put with ``free``)."""
        with self.lock:  # under the lock: `refill` may run on another thread
            entry = self.relays[key]
            entry[1] -= 1
            if entry[1]:
                return
            del self.relays[key]
            if entry[2]:
                for t in entry[0]:
                    t.untyped_storage().resize_(0)

    def refill(self, key: tuple, stashed: Sequence[torch.Tensor]) -> None:
        """A backward's relayed copy (``key``) written into the ``stashed`` tensors its forward
        used (their storage was freed; autograd's saved tensors share it), which then stand
        for the copy (its send reads them)."""
        with self.lock:
            entry = self.relays[key]
            forward = self.relays.get((("param",) + key[0][1:], key[1]))
            if forward is not None:
                # the forward's copy is still to be sent on (a slow send): it was not freed,
                # and must not be once the backward uses it
                forward[2] = False
            for p, q in zip(stashed, entry[0]):
                if p.untyped_storage().nbytes() == 0:
                    p.untyped_storage().resize_(q.numel() * q.element_size())
                    p.data.copy_(q)  # .data: autograd's version counter stays
            entry[0] = list(stashed)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the versions and relayed copies held now."""
        with self.lock:
            return [t for e in list(self.entries.values()) + list(self.relays.values())
                    for t in e[0]]

    def put(self, stage: int, version: int, tensors: Sequence[torch.Tensor]) -> None:
        """A version arrived (or was made); kept for its reads on this rank."""
        reads = self.uses(stage, version)
        if reads <= 0:
            return
        key = (stage, version)
        with self.lock:
            # ``uses`` counts every read of the version on this rank, however many times it
            # is delivered (ZeRO relays version 0 for cycles 0 and 1): a second copy is dropped
            if key not in self.entries:
                self.entries[key] = [list(tensors), reads]
            self._note(stage)

    def _entry(self, stage: int, version: int) -> list:
        entry = self.entries.get((stage, version))
        if entry is None:
            have = sorted(v for (s, v) in self.entries if s == stage)
            raise PlanError(f"CDP: version {version} of stage {stage} is not on this rank "
                            f"(it holds versions {have}): a schedule bug")
        return entry

    def take(self, stage: int, version: int, sending: bool = False) -> list[torch.Tensor]:
        """One read of a version (freed after its last). ``sending``: the read of a send,
        which goes on after this call (the exchange copies the tensors) until `sent`; until
        then the version is not `unused` (else the owner's update could write into the
        tensors the send copies), though no longer counted live."""
        key = (stage, version)
        with self.lock:
            entry = self._entry(stage, version)
            entry[1] -= 1
            if entry[1] == 0:
                del self.entries[key]
            if sending:
                self.sending[key] = self.sending.get(key, 0) + 1
            return entry[0]

    def sent(self, stage: int, version: int) -> None:
        """A send's read (`take` with ``sending``) is over: its copy was made."""
        key = (stage, version)
        with self.lock:
            left = self.sending[key] - 1
            if left:
                self.sending[key] = left
            else:
                del self.sending[key]

    def unused(self, stage: int, version: int) -> bool:
        """Whether no read of ``version`` is left on this rank and no micro-batch holds it:
        its tensors are nobody's but the caller's (nor is a send still copying them)."""
        key = (stage, version)
        with self.lock:
            return (key not in self.entries and key not in self.sending
                    and not self.held[stage].get(version))

    def latest(self, stage: int) -> int | None:
        with self.lock:
            have = [v for (s, v) in self.entries if s == stage]
        return max(have) if have else None

    def peek(self, stage: int, version: int) -> list[torch.Tensor]:
        """A version's tensors, without counting a read."""
        with self.lock:
            return self._entry(stage, version)[0]

    def hold(self, stage: int, version: int) -> None:
        """A micro-batch's forward keeps ``version`` until its backward."""
        with self.lock:
            h = self.held[stage]
            before = h.get(version, 0)
            h[version] = before + 1
            if not before and (stage, version) not in self.entries:  # (else already live)
                self._note(stage)

    def drop(self, stage: int, version: int) -> None:
        with self.lock:
            h = self.held[stage]
            h[version] -= 1
            if h[version] == 0:
                del h[version]


def owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is the whole of its storage (pickling or freeing it touches only it)."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


class StageOwner:
    """The optimizer of one stage, built by ``optimizer(params)`` on parameters laid out on
    this rank alone (``pl``); ``n`` workers' gradient sums are averaged before each step.
    A version holds ``nparams`` parameters, then the stage's buffers."""

    def __init__(self, first: Sequence[torch.Tensor], pl: Placement, n: int,
                 optimizer: Callable, nparams: int) -> None:
        self.n, self.nparams = n, nparams
        self.params = [Parameter(GlobalTensor(t.detach(), tuple(t.shape), pl, (B,)))
                       for t in first[:nparams]]
        self.optimizer = optimizer(self.params)
        if not (hasattr(self.optimizer, "step") and hasattr(self.optimizer, "state")):
            raise PlanError(f"CyclicDataParallel: optimizer(params) must return an sf.optim "
                            f"optimizer, got {type(self.optimizer).__name__}")

    def tensors(self) -> list[torch.Tensor]:
        """The stage's latest parameters and its optimizer state (local tensors)."""
        out = [p.local for p in self.params]
        for state in list(self.optimizer.state.values()):
            for v in list(state.values()):
                if isinstance(v, GlobalTensor):
                    out.append(v.local)
                elif isinstance(v, torch.Tensor):
                    out.append(v)
        return out

    def step(self, latest: Sequence[torch.Tensor], total: Sequence[torch.Tensor],
             in_place: bool = False) -> list[torch.Tensor]:
        """The next version from the ``latest`` one and the workers' sum of gradients (then
        of buffer changes; a sum the caller made and reads no more: averaged in place).
        ``in_place``: nothing reads ``latest`` any more (`VersionStore.unused`), so the update
        writes into it instead of a copy."""
        k = self.nparams
        for p, t, g in zip(self.params, latest[:k], average(total[:k], self.n, into=True)):
            local = (t.detach() if in_place else t.detach().clone()).requires_grad_(True)
            local.grad = g
            p._local = local  # (a copy unless unused: micro-batches in flight keep theirs)
        self.optimizer.step()
        out = []
        for p in self.params:
            p.local.grad = None
            out.append(p.local)
        return out + advance(latest[k:], total[k:], self.n)
