"""A graph's mean over a count summed over the ranks, with that all-reduce kept out of the
forward's way (the graph form of `sbpflow.nn.eager_count_mean`).

The recorded task starts the count's all-reduce and divides by a guess: the count with nothing
ignored (a target's element count) or else the traced count. Backward runs at once with the
guess when scaling the gradients afterwards undoes a wrong one; at its end the count is waited
for (it arrived long before) and a wrong guess is corrected: the loss value and the gradients
rescaled, the started gradient all-reduces dropped (the optimizer redoes them), and the task
waits in every later call. Otherwise (gradients already there, build not calling
``backward()`` on this loss, the value read by other tasks) the task waits. Over micro-batches
weighted by rows each divides by its share of the batch's guessed count and the last backward
corrects it (`_Shares`). See docs/internals.md, 'The pending mean'.
"""
from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch

from ..comm import current as _current_comm
from ..errors import GraphError
from ..gradsync import drop_started
from ..placement import Placement
from ..tensor import GlobalTensor, current_recorder, retains_grads

__all__ = ["record_mean", "settle_means", "upstream_scale", "scale_grads"]

_LOCAL = operator.attrgetter("_local")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class _LeafCache(NamedTuple):
    """The last walk of a recorded mean's backward: the externals read, their shards, the
    shards' ``requires_grad``, the leaves reached."""

    tensors: list
    shards: list
    flags: list
    leaves: list


class _Guessing:
    """What the calls of one recorded mean share: whether ``backward()`` is called on it (seen
    while tracing), whether guessing still holds (a wrong guess stops it, on every rank), and
    the leaves its backward reached (`leaves`)."""

    __slots__ = ("backward_seen", "on", "externals", "cache", "value_read", "upstream")

    def __init__(self, on: bool, externals: list) -> None:
        self.backward_seen, self.on = False, on
        self.value_read = False  # other tasks read the value (`CountedMean.read_by_tasks`)
        # the stages before this one scale their gradients too (`CountedMean.corrected_upstream`)
        self.upstream = False
        self.externals = externals  # the tape's (slot, tensor) re-read at each replay
        self.cache: _LeafCache | None = None   # the last walk's, while it holds

    def leaves(self, root: torch.Tensor) -> list[torch.Tensor]:
        """The leaves backward from ``root`` reaches: walked once, then the same list while
        they are all shards of the tape's externals (the parameters) and every external reads
        the same shard with the same ``requires_grad`` (the replayed tape then builds the same
        graph over them; the inputs' ``requires_grad`` is part of the compiled signature). A
        leaf that is not an external (an input or a received value requiring grad) is new each
        call: walked each time."""
        # (C-level maps: the check costs well under a microsecond an external)
        c = self.cache
        tensors = [t for _, t in self.externals] if c is None else c.tensors
        shards = list(map(_LOCAL, tensors))
        flags = list(map(_REQUIRES_GRAD, shards))
        if c is not None and c.flags == flags and all(map(operator.is_, c.shards, shards)):
            return c.leaves
        leaves = _leaves(root)
        known = set(map(id, shards))
        self.cache = _LeafCache(tensors, shards, flags, leaves) \
            if all(id(v) in known for v in leaves) else None
        return leaves


class _TracedMean(GlobalTensor):
    """The traced mean: notes that ``build`` calls ``backward()`` on it."""

    __slots__ = ("_guessing",)

    def backward(self, gradient: GlobalTensor | None = None, retain_graph: bool = False) -> None:
        if gradient is None:
            self._guessing.backward_seen = True
        GlobalTensor.backward(self, gradient, retain_graph)


def record_mean(total: GlobalTensor, count: GlobalTensor, reduced: tuple, group: tuple,
                full: float | None) -> GlobalTensor:
    """While tracing: ``total / count`` (``count`` all-reduced over ``group``, laid out
    ``reduced``; ``group`` None: ``count`` is the whole count already) recorded as a
    `CountedMean` task; ``full``: the count when nothing is ignored (the guess; None: the
    traced count)."""
    summed = count.local.detach() if group is None else \
        _current_comm().all_reduce(count.local.detach(), group, "sum")
    value = _as_dtype(total.local / summed, total.dtype)
    out = _TracedMean(value, (), total.placement, total.sbp)
    rec = current_recorder()
    guessing = _Guessing(rec.micro_batches == 1, rec.externals)
    out._guessing = guessing
    guess = float(summed) if full is None else float(full)
    # over weighted micro-batches: which of the tape's means this is (a call's `_Shares` key)
    index = sum(isinstance(n, CountedMean) for n in rec.nodes) if rec.weighs_means else None
    pl = total.placement
    rec.task(lambda r, o, mode: CountedMean(r, o, pl, mode, group, guess, count.dtype, guessing,
                                            index, full is not None),
             [total, count], [out], pl)
    return out


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


class CountedMean(NamedTuple):
    """``vals[out] = vals[total] / all_reduce(vals[count])``, replayed without waiting for the
    all-reduce when the guess may be used (module docstring)."""

    slots_read: tuple       # (total, count)
    slots_written: tuple    # (out,)
    placement: Placement
    mode: Any
    group: tuple
    guess: float
    count_dtype: torch.dtype
    guessing: _Guessing
    index: int | None = None    # over weighted micro-batches: its `_Shares` key, else None
    exact: bool = False         # the guess is an element count (an integer)

    @property
    def name(self) -> str:
        return "mean_over_count"

    def corrected_upstream(self, ok: bool) -> None:
        """Told by a pipelined graph once traced: whether the stages before this mean's scale
        their gradients by this mean's correction (`settle_means`, then the graph plan's
        `scale_actors`): they do when this is the graph's only such mean and its only loss."""
        self.guessing.upstream = ok

    def read_by_tasks(self, read: bool) -> None:
        """Told by the graph once traced: whether other tasks read the value (a value computed
        with a wrong guess would reach them before the correction): then it never guesses."""
        self.guessing.value_read = read
        if read:
            self.guessing.on = False

    def __repr__(self) -> str:
        t, c = self.slots_read
        return (f"%{self.slots_written[0]} = mean_over_count(%{t}, all_reduce(%{c}))  "
                f"[guess {self.guess:g}]")

    def run(self, vals: list, env: Any) -> None:
        t, c = self.slots_read
        total = vals[t]
        # started the same way on every rank whatever is guessed: the collectives agree
        pending = _Ready(vals[c].detach()) if self.group is None else \
            env.comm.all_reduce_start(vals[c].detach(), self.group, "sum", inplace=True)
        if self.index is not None:
            return self._run_share(vals, env, total, pending)
        g = self.guessing
        if not (g.on and g.backward_seen and total.requires_grad and torch.is_grad_enabled()):
            vals[self.slots_written[0]] = _as_dtype(total / pending.wait(), total.dtype)
            return
        call = _ReplayCount(pending, self.guess, torch.full((), self.guess, dtype=self.count_dtype,
                                                     device=total.device), g)
        out = _GuessedQuotient.apply(total, call)
        # detached aliases: the value's storage, without a cycle through the autograd graph
        call.out, call.total = out.detach(), total.detach()
        vals[self.slots_written[0]] = out


    def _run_share(self, vals: list, env: Any, total: torch.Tensor, pending) -> None:
        """One of several micro-batches weighted by their rows (``env.weight`` this one's):
        ``total / (weight * R)``, recorded in the call's ``env.means`` (`_Shares`)."""
        shares = env.means.get(self.index)
        if shares is None:   # the call's first micro-batch: R and what a correction may touch
            shares = env.means[self.index] = _Shares(self, total, env)
        divisor = torch.full((), env.weight * shares.divisor, dtype=self.count_dtype,
                             device=total.device)
        out = _as_dtype(total / divisor, total.dtype)
        shares.pending.append(pending)
        shares.outs.append(out.detach())
        vals[self.slots_written[0]] = out


class _Ready(NamedTuple):
    """A count that needs no all-reduce, read as a pending one."""

    value: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.value


class _Shares:
    """One call's micro-batches of one recorded mean, each weighted by its share of the batch's
    rows (``weight``). Micro-batch m's value is ``total_m / (weight_m * R)``, R the batch's
    guessed count (micro-batch 0's guess over its weight: the batch's element count when
    nothing is ignored), so the weighted values and the gradients they seed add up to
    ``sum_m total_m / R``. `settle` sums the counts and corrects a wrong R by scaling every
    value and the gradients by ``R / count``: exact when build calls ``backward()`` on this
    mean, the leaves it reaches are the parameters, without gradients or hooks before the
    call, and no other task reads the value; otherwise a wrong R is refused."""

    __slots__ = ("divisor", "pending", "outs", "leaves", "why_not", "upstream", "scale",
                 "settled")

    def __init__(self, node: CountedMean, total: torch.Tensor, env: Any) -> None:
        r = node.guess / env.weight
        self.divisor = float(round(r)) if node.exact else r
        self.pending: list = []
        self.outs: list = []
        self.settled = False
        self.scale = 1.0   # the correction made (`scale_actors` hands it to earlier stages)
        g = node.guessing
        grads = total.requires_grad and torch.is_grad_enabled()
        leaves = g.leaves(total) if grads and g.backward_seen else []
        self.why_not, self.leaves, self.upstream = _correction(g, grads, leaves, env.received)

    def settle(self) -> None:
        """Once the last micro-batch's backward is done (or the call's forwards, without
        one): sum the counts and correct a wrong R, or raise `GraphError`."""
        if self.settled:
            return
        self.settled = True
        count = sum(float(p.wait()) for p in self.pending)
        if count == self.divisor:
            return
        if self.why_not:
            raise GraphError(
                f"graph: a mean over the targets kept, over {len(self.pending)} micro-batches, "
                f"counted {count:g} where {self.divisor:g} was guessed, and the correction "
                f"cannot be made exactly: {self.why_not}. Sum instead: "
                f"config.set_loss_reduction('sum') and reduction='sum' divided by the batch's "
                f"count of kept targets, given as an input that is not split "
                f"(docs/runtime.md, 'Graph mode')")
        scale = self.divisor / count if count else float("inf")   # torch: 0/0 is nan
        with torch.no_grad():
            for out in self.outs:
                out.mul_(scale)
        if self.leaves:
            _rescale(self.leaves, scale)
        self.scale = scale


def _correction(g: _Guessing, grads: bool, leaves: list, received: frozenset) -> tuple:
    """(why scaling afterwards would not give the exact value and gradients, '' when it
    would; the leaves to scale here: the parameters; whether the earlier stages of a pipeline
    scale theirs), read when the call's first micro-batch runs, before any of its backwards.
    ``received``: the ids of the activations this stage received."""
    if g.value_read:
        return "other tasks of build read its value", [], False
    if not grads:
        return "", [], False
    if not g.backward_seen:
        return "build does not call backward() on the mean itself", [], False
    if retains_grads():
        return "a tensor retains its gradient", [], False
    params, upstream = leaves, False
    if g.cache is None:   # `_Guessing.leaves` keeps its walk only when the leaves are externals
        known = {id(t.shard) for _, t in g.externals if isinstance(t, GlobalTensor)}
        params = [v for v in leaves if id(v) in known]
        others = [v for v in leaves if id(v) not in known]
        if any(id(v) not in received for v in others):
            return ("its backward reaches inputs of build that require grad (each "
                    "micro-batch's gradient leaves with it)"), [], False
        if not g.upstream:
            return ("its backward reaches another stage's activations, and the pipeline has "
                    "other losses or means whose gradients its correction would scale"), [], False
        upstream = True
    if not all(map(_correctable, params)):
        return "a parameter it reaches has a gradient from before the call, or a hook", [], False
    return "", params, upstream


def settle_means(means: dict | None) -> None:
    """`_Shares.settle` of every mean of a call (``means``: its `_Shares` by index)."""
    for shares in (means or {}).values():
        shares.settle()


def upstream_scale(means: dict | None) -> tuple[float, bool]:
    """(the correction this rank's settled mean hands the earlier stages of a pipeline,
    whether this rank holds one): `settle_means` first."""
    for shares in (means or {}).values():
        if shares.upstream:
            return shares.scale, True
    return 1.0, False


def scale_grads(params: list, scale: float) -> None:
    """An earlier stage's part of a correction: scale the gradients of ``params`` (global
    tensors; those without one are skipped) and drop the started all-reduces, as the stage
    of the mean did (`_rescale`)."""
    leaves = [p.shard for p in params if p.shard.grad is not None]
    _rescale(leaves, scale)


class _ReplayCount:
    """One replay's count: the all-reduce in flight, the guess, the output to correct."""

    __slots__ = ("pending", "guess", "guess_t", "guessing", "out", "total", "_count")

    def __init__(self, pending, guess: float, guess_t: torch.Tensor, guessing: _Guessing) -> None:
        self.pending, self.guess, self.guess_t, self.guessing = pending, guess, guess_t, guessing
        self.out = self.total = self._count = None

    def count(self) -> torch.Tensor:
        if self._count is None:
            self._count = self.pending.wait()
        return self._count

    def fix_if_missed(self) -> float | None:
        """Wait for the count; on a wrong guess correct the value in place (its readers share
        it), stop guessing, and return ``guess / count``; else None."""
        count = self.count()
        if float(count) == self.guess:
            return None
        self.guessing.on = False   # the same on every rank: the count is all-reduced
        with torch.no_grad():
            self.out.copy_(_as_dtype(self.total / count, self.total.dtype))
        return self.guess / float(count)


class _GuessedQuotient(torch.autograd.Function):
    """``total / guess``; backward divides by the guess and corrects at the end of backward
    when that can be undone exactly by scaling, else waits for the count."""

    @staticmethod
    def forward(ctx, total: torch.Tensor, call: _ReplayCount) -> torch.Tensor:
        ctx.call, ctx.total_dtype = call, total.dtype
        ctx.graph_root = total   # the leaves are found from it in backward
        return _as_dtype(total.detach() / call.guess_t, total.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        call = ctx.call
        leaves = call.guessing.leaves(ctx.graph_root)
        if not retains_grads() and all(map(_correctable, leaves)):
            _last_callback(lambda: _settle(call, leaves))
            count = call.guess_t
        else:
            call.fix_if_missed()
            count = call.count()
        g = grad / count if grad.dtype == count.dtype else (grad.to(count.dtype) / count)
        return _as_dtype(g, ctx.total_dtype), None


def _last_callback(fn) -> None:
    """Run ``fn`` at the end of this backward pass, after the callbacks that nodes further
    from the loss queue (ZeRO's `zero.gather._drain` adds the reduce-scattered shards to the
    gradients then: a correction before it scaled nothing). A callback may queue another,
    which runs after those queued before it."""
    queue = torch.autograd.Variable._execution_engine.queue_callback
    queue(lambda: queue(fn))


def _settle(call: _ReplayCount, leaves: list) -> None:
    """The end of a backward that used the guess: undo a wrong one (docs/internals.md, 'The
    pending mean')."""
    scale = call.fix_if_missed()
    if scale is not None:
        _rescale(leaves, scale)


def _rescale(leaves: list, scale: float) -> None:
    """Undo a wrong guess in the gradients a backward gave ``leaves`` (``scale``: guess /
    count), and drop the gradient all-reduces started with them: every rank guessed wrong,
    the optimizer redoes them."""
    with torch.no_grad():
        for leaf in leaves:
            if leaf.grad is not None:
                leaf.grad.mul_(scale)
    drop_started()


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


def _correctable(leaf: torch.Tensor) -> bool:
    """Whether scaling ``leaf.grad`` afterwards undoes a wrong guess: no gradient before this
    backward (accumulating into one), no hook that saw the guessed gradient (a post-
    accumulate hook is fine if it is redone when the started all-reduces are dropped)."""
    if leaf.grad is not None or leaf._backward_hooks:
        return False
    post = leaf._post_accumulate_grad_hooks
    if post:  # (a loop, not all() over a generator: this runs for every leaf every call)
        for h in post.values():
            if not getattr(h, "redone_when_dropped", False):
                return False
    return True
