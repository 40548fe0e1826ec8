"""A mean whose divisor is a count summed over the ranks (a cross-entropy's valid targets), with
that all-reduce kept out of the forward.

`mean_over_count` starts the count's all-reduce and, when the stream's two previous means had
equal counts, goes on with that count as a guess: the value is read only once the count has
arrived (`PendingMean`), and ``backward()`` runs at once with the guess and corrects a wrong one
afterwards (every rank makes the same guess). ``guess_counts = False`` makes every mean wait.
See docs/internals.md, 'The pending mean' (when backward may guess, what it cannot see).
"""
from __future__ import annotations

from collections import deque

import torch

from .. import comm as _comm
from ..boxing import plan_layouts
from ..caches import memoize
from ..gradsync import drop_started
from ..layouts import Layout
from ..placement import Placement
from ..sbp import B, Partial
from ..tensor import GlobalTensor, current_recorder, recording, retains_grads
from .graph_count_mean import _correctable, _leaves, _rescale, record_mean

__all__ = ["PendingMean", "mean_over_count", "guess_counts", "weighs_means"]

# Set to False (on every rank) to make every mean wait for its count before backward.
guess_counts = True


class _CountStream:
    """The counts of one stream of means on this rank: the last two, and the all-reduces still
    pending, in the order they were started."""

    __slots__ = ("counts", "pending")

    def __init__(self) -> None:
        self.counts: list[float] = []
        self.pending: deque = deque()

    def settle(self) -> None:
        """Record the counts of this stream's earlier means, in the order they were started
        (every rank started their all-reduces, so waiting for them ends): the history is then
        the same on every rank, whichever means a rank's caller happened to read."""
        while self.pending:
            self.observe(float(self.pending.popleft().wait()))

    def observe(self, count: float) -> None:
        self.counts.append(count)
        del self.counts[:-2]

    def guess(self) -> float | None:
        c = self.counts
        return c[0] if guess_counts and len(c) == 2 and c[0] == c[1] else None


def _stream(key: tuple) -> _CountStream:
    streams = _comm.current().per_rank.pending_mean_streams
    if len(streams) > 1024:
        streams.clear()
    s = streams.get(key)
    if s is None:
        s = streams[key] = _CountStream()
    return s


def mean_over_count(total: GlobalTensor, count: GlobalTensor, stream: tuple,
                    full: float | None = None) -> GlobalTensor:
    """``total / count`` of 0-d tensors, ``count`` summed over its partial mesh dims.

    Layouts: ``total`` any (P or B per mesh dim), ``count`` the same or with more P dims; the
    result is laid out as ``total``. Communicated: one all-reduce of the count (4-8 bytes).
    Returns a `PendingMean` when the all-reduce can stay in flight (docs/internals.md, 'The
    pending mean'): the count needs one, ``total`` requires grad and ``count`` does not
    (weights that learn make it a differentiable sum), and the placement holds every rank (a
    rank outside it could not correct its gradients). ``stream`` names the sequence of counts the
    guess is taken from (e.g. the target's shape, layout and ignore_index). ``count``'s shard
    may be reduced in place: pass a tensor nothing else reads. While a graph traces, the
    mean is recorded so that its replay does not wait either (`sbpflow.nn.graph_count_mean`;
    ``full``: the count when nothing is ignored, its guess), and so is every mean of a graph
    that weights micro-batches by their rows (the batch's count is known only at the end).
    """
    pl = count.placement
    comm = _comm.current()
    reduced, group = _route(pl, count.sbp, count.dtype, comm.rank, comm.world_size)
    if recording() and weighs_means():
        # micro-batches weighted by rows: recorded whatever the layout (`_Shares`), the count
        # boxed in the forward when one all-reduce does not give it. (A count that learns, of
        # class weights requiring grad, was refused: `functional._check_counted_mean`; a rank
        # outside the placement sees requires_grad on it, and must record the same task.)
        if group is None:
            count = count.to_global(sbp=reduced)
        return record_mean(total, count, reduced, group, full)
    if group is not None and recording() and total.requires_grad and \
            not count.requires_grad and torch.is_grad_enabled():
        return record_mean(total, count, reduced, group, full)
    if group is None or not total.requires_grad or count.requires_grad or \
            not torch.is_grad_enabled() or recording():  # a graph replays the plain quotient
        return _as_dtype(total / count.to_global(sbp=reduced), total.dtype)
    stream_ = _stream((stream, pl, count.sbp))
    stream_.settle()
    guess = stream_.guess()
    if guess is None:
        summed = comm.all_reduce(count.local.detach(), group, "sum")
        stream_.observe(float(summed))
        return _as_dtype(total / GlobalTensor(summed, (), pl, reduced), total.dtype)
    # in place: the count's shard is this call's alone (a copy costs as much as the launch)
    pending = comm.all_reduce_start(count.local.detach(), group, "sum", inplace=True)
    stream_.pending.append(pending)
    return PendingMean._make(total, pending, guess, count.dtype)


def weighs_means() -> bool:
    """Whether the graph being traced weights each micro-batch's mean loss by its share of the
    batch's rows (several micro-batches, loss reduction "mean")."""
    rec = current_recorder()
    return rec is not None and rec.weighs_means


def _as_dtype(t, dtype: torch.dtype):
    """A quotient (global or local) in the sum's dtype (a float32 count of a 16-bit sum
    promotes it)."""
    return t if t.dtype == dtype else t.to(dtype)


@memoize(256)
def _route(pl: Placement, sbp: tuple, dtype: torch.dtype, rank: int,
           world: int) -> tuple[tuple, tuple | None]:
    """(``sbp`` with its partial dims reduced, this rank's group of the one sum all-reduce that
    does it), the group None when it is not that (no P dim, other steps, P(max)), or when
    ``pl`` leaves out a rank of the world."""
    reduced = tuple(B if isinstance(s, Partial) else s for s in sbp)
    if reduced == sbp or sorted(pl.flat_ranks) != list(range(world)):
        return reduced, None
    plan = plan_layouts((), dtype, Layout.parsed(pl, sbp), Layout.parsed(pl, reduced))
    group = plan.all_reduce_group(rank)
    return reduced, (group if group is not None and plan.steps[0].op == "sum" else None)


class PendingMean(GlobalTensor):
    """A 0-d `GlobalTensor` ``total / count`` whose count is still being all-reduced (made by
    `mean_over_count`). Its shard is computed on first use, after the count arrives;
    ``backward()`` may run before (docs/internals.md, 'The pending mean'). Metadata (shape,
    dtype, placement, sbp, requires_grad) is available at once."""

    __slots__ = ("_total", "_pending", "_guess", "_spec", "_value")

    @classmethod
    def _make(cls, total: GlobalTensor, pending, guess: float,
              count_dtype: torch.dtype) -> "PendingMean":
        t = object.__new__(cls)
        t._shape, t._placement, t._sbp, t._key = total._shape, total._placement, total._sbp, None
        t._boxes = None
        t._total, t._pending, t._guess, t._value = total._local, pending, guess, None
        # divided by a count tensor, as waiting does, so a right guess gives the same bits
        t._spec = t._quotient(torch.full((), guess, dtype=count_dtype, device=total.device))
        return t

    def _quotient(self, count: torch.Tensor) -> torch.Tensor:
        return _as_dtype(self._total / count, self._total.dtype)

    # the shard: whoever reads it waits for the count
    @property
    def _local(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._quotient(self._count()) if self._miss() else self._spec
        return self._value

    def _count(self) -> torch.Tensor:
        """The all-reduced count (waits for it)."""
        return self._pending.wait()

    def _miss(self) -> bool:
        return float(self._count()) != self._guess

    def __reduce__(self):
        """Copied or pickled as the plain `GlobalTensor` of its value."""
        return GlobalTensor, (self._local, self._shape, self._placement, self._sbp)

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
        with the guessed count and checks it afterwards (docs/internals.md, 'The pending
        mean')."""
        leaves = None
        if gradient is None and self._value is None and not retains_grads():
            leaves = _leaves(self._spec)
            if not all(map(_correctable, leaves)):
                leaves = None  # a wrong guess could not be undone exactly: wait
        if leaves is None:
            GlobalTensor.backward(self, gradient, retain_graph)  # reads _local: waits
            if self._miss():
                drop_started()  # every rank guessed wrong: the optimizer redoes them
            return
        torch.autograd.backward(self._spec, self._seed(None), retain_graph=retain_graph)
        if self._miss():
            _rescale(leaves, self._guess / float(self._count()))
        self._local  # noqa: B018 - the value, now that the count is here

