"""A mean whose divisor is a count summed over the ranks (a cross-entropy's valid targets), with
that all-reduce kept out of the forward.

``total / count`` for 0-d tensors, ``total`` partial (P) or replicated, ``count`` partial: the
count must be all-reduced before the division, and a blocking scalar all-reduce at the end of
the forward is a point where every rank waits for the slowest (DDP has no such point: it
averages per-rank means, which differ from the mean when ranks hold different numbers of valid
targets). `mean_over_count` starts the all-reduce and, when the count of the same stream (same
target shape, layout, ignore_index) was equal in the last two steps, goes on with that count as
a guess:

* the value is computed with the guess, and read only after the count has arrived (`PendingMean`:
  reading the value, using it in another op or anything else that needs its shard waits, and
  recomputes it if the guess was wrong), so no caller ever sees a guessed value;
* ``backward()`` on it runs at once with the guess — the all-reduce completes meanwhile — and
  checks the guess when backward is done. A wrong guess (the count changed) scales this
  backward's gradients by ``guess / count``, every rank drops the gradient all-reduces that
  started during backward (`sf.optim` redoes them), and the stream waits again until its count
  is stable.

A guessed backward needs the exact correction to be possible, so it is used only when every
leaf it reaches has no gradient yet (no accumulation into an earlier micro-batch's gradient)
and no tensor retains its gradient (``retain_grad``); otherwise backward waits for the count
first. Both give torch's gradients; a right guess gives the bits waiting would have given.
The leaves are found by walking the autograd graph, which sees everything sbpflow's ops
record (its activation checkpointing is torch's non-reentrant one); a nested backward run by
user code on local shards (``torch.utils.checkpoint(..., use_reentrant=True)``) would hide its
leaves from the correction.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .. import comm as _comm
from ..boxing import plan_layouts
from ..placement import Placement
from ..sbp import B, Partial
from ..tensor import GlobalTensor, retains_grads

__all__ = ["PendingMean", "mean_over_count"]


def _history(stream: tuple) -> list:
    """This rank's last two counts of ``stream`` (the same on every rank: they are all-reduced)."""
    streams = _comm.current().state.setdefault("pending_mean_counts", {})
    if len(streams) > 1024:
        streams.clear()
    return streams.setdefault(stream, [])


def _observe(stream: tuple, count: float) -> None:
    h = _history(stream)
    h.append(count)
    del h[:-2]


def _guess(stream: tuple) -> float | None:
    h = _history(stream)
    return h[0] if len(h) == 2 and h[0] == h[1] else None


def mean_over_count(total: GlobalTensor, count: GlobalTensor, stream: tuple) -> GlobalTensor:
    """``total / count`` of 0-d tensors, ``count`` summed over its partial mesh dims.

    Layouts: ``total`` any (P or B per mesh dim), ``count`` the same or with more P dims; the
    result is laid out as ``total``. Communicated: one all-reduce of the count (4-8 bytes).
    Returns a `PendingMean` when the all-reduce can stay in flight (see the module docstring):
    the count needs one, ``total`` requires grad and ``count`` does not (weights that learn
    make it a differentiable sum), and the placement holds every rank (a rank outside it
    could not correct its gradients). ``stream`` names the sequence of counts the
    guess is taken from (e.g. the target's shape, layout and ignore_index). ``count``'s shard
    may be reduced in place: pass a tensor nothing else reads.
    """
    pl = count.placement
    comm = _comm.current()
    reduced, group = _route(pl, count.sbp, count.dtype, comm.rank, comm.world_size)
    if group is None or not total.requires_grad or count.requires_grad or \
            not torch.is_grad_enabled():
        return total / count.to_global(sbp=reduced)
    key = (stream, pl, count.sbp)
    guess = _guess(key)
    if guess is None:
        summed = comm.all_reduce(count.local.detach(), group, "sum")
        _observe(key, float(summed))
        return total / GlobalTensor(summed, (), pl, reduced)
    # in place: the count's shard is this call's alone (a copy costs as much as the launch)
    pending = comm.all_reduce_start(count.local.detach(), group, "sum", inplace=True)
    return PendingMean._make(total, pending, guess, count.dtype, key)


@lru_cache(maxsize=256)
def _route(pl: Placement, sbp: tuple, dtype: torch.dtype, rank: int,
           world: int) -> tuple[tuple, tuple | None]:
    """(``sbp`` with its partial dims reduced, this rank's group of the one sum all-reduce that
    does it), the group None when it is not that (no P dim, other steps, P(max)), or when
    ``pl`` leaves out a rank of the world."""
    reduced = tuple(B if isinstance(s, Partial) else s for s in sbp)
    if reduced == sbp or sorted(pl.flat_ranks) != list(range(world)):
        return reduced, None
    steps = plan_layouts((), dtype, pl, sbp, pl, reduced).steps
    if len(steps) != 1 or steps[0].kind != "all_reduce" or steps[0].op != "sum":
        return reduced, None
    return reduced, pl.group(steps[0].dims, pl.coord_of(rank))


class PendingMean(GlobalTensor):
    """A 0-d `GlobalTensor` ``total / count`` whose count is still being all-reduced (made by
    `mean_over_count`). Its shard is computed on first use, after the count arrives;
    ``backward()`` may run before (module docstring). Metadata (shape, dtype, placement, sbp,
    requires_grad) is available at once."""

    __slots__ = ("_total", "_pending", "_guess", "_stream", "_spec", "_value")

    @classmethod
    def _make(cls, total: GlobalTensor, pending, guess: float, count_dtype: torch.dtype,
              stream: tuple) -> "PendingMean":
        t = object.__new__(cls)
        t._shape, t._placement, t._sbp, t._key = total._shape, total._placement, total._sbp, None
        t._total, t._pending, t._guess, t._stream = total._local, pending, guess, stream
        # divided by a count tensor, as waiting does, so a right guess gives the same bits
        t._spec = total._local / torch.full((), guess, dtype=count_dtype,
                                            device=total._local.device)
        t._value = None
        return t

    # the shard: whoever reads it waits for the count
    @property
    def _local(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._total / self._count() if self._miss() else self._spec
        return self._value

    def _count(self) -> torch.Tensor:
        """The all-reduced count (waits for it once; recorded in the stream's history)."""
        pending = self._pending
        if not isinstance(pending, torch.Tensor):
            self._pending = pending = pending.wait()
            _observe(self._stream, float(pending))
        return pending

    def _miss(self) -> bool:
        return float(self._count()) != self._guess

    # metadata without waiting
    @property
    def dtype(self) -> torch.dtype:
        return self._spec.dtype

    @property
    def device(self) -> torch.device:
        return self._spec.device

    @property
    def requires_grad(self) -> bool:
        return self._spec.requires_grad

    def backward(self, gradient: GlobalTensor | None = None, retain_graph: bool = False) -> None:
        """`GlobalTensor.backward`; without ``gradient``, before the value was read, it runs
        with the guessed count and checks it afterwards (module docstring)."""
        leaves = None
        if gradient is None and self._value is None and not retains_grads():
            leaves = _leaves(self._spec)
            if any(leaf.grad is not None for leaf in leaves):
                leaves = None  # accumulating: a wrong guess could not be undone exactly
        if leaves is None:
            GlobalTensor.backward(self, gradient, retain_graph)  # reads _local: waits
            if self._miss():
                _drop_started_grad_syncs()
            return
        torch.autograd.backward(self._spec, self._seed(None), retain_graph=retain_graph)
        if self._miss():
            scale = self._guess / float(self._count())
            with torch.no_grad():
                for leaf in leaves:
                    if leaf.grad is not None:
                        leaf.grad.mul_(scale)
            _drop_started_grad_syncs()
        self._local  # noqa: B018 - the value, now that the count is here


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors backward from ``t`` accumulates into (its graph's AccumulateGrad nodes)."""
    fn = t.grad_fn
    if fn is None:
        return [t] if t.requires_grad else []
    leaves, seen, stack = [], {fn}, [fn]
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is None or nxt in seen:
                continue
            seen.add(nxt)
            var = getattr(nxt, "variable", None)
            if var is not None:
                leaves.append(var)
            else:
                stack.append(nxt)
    return leaves


def _drop_started_grad_syncs() -> None:
    """Every rank saw the same wrong guess: forget the gradient all-reduces started during this
    backward (they may hold guessed gradients); the optimizer reduces the gradients again."""
    from ..optim.grad_sync import drop_started  # the optim layer imports nn: import late
    drop_started()
