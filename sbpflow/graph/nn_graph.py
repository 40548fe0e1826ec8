"""``sf.nn.Graph``: a training step traced once, lowered to actors, replayed on every call.

A subclass registers modules and optimizers (``add_optimizer``) in ``__init__`` and writes
``build(*inputs)`` (forward, ``loss.backward()``, return the loss). The first call with given
input shapes and layouts compiles (`Compiled`): ``build`` is traced on each distinct micro-batch
shape, cut into stages where the placement changes, and turned into a runtime plan; later calls
only run the plan. See docs/runtime.md, 'Graph mode'.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

from .. import comm as _comm
from ..errors import GraphError
from ..nn.modules import Module
from ..zero.layout import check_min_size, check_stage
from ..zero.pending import settle
from ..zero.units import shard_ as _zero_shard
from ..runtime import save_timeline as _save_timeline
from ..runtime import save_trace as _save_trace
from ..runtime.schedules import SCHEDULES
from .compiled import Compiled
from .microbatch import flatten_inputs, signature

__all__ = ["Graph", "GraphConfig"]


class GraphConfig:
    """How a `Graph` runs a step. Set in the subclass's ``__init__``, before the first call."""

    def __init__(self) -> None:
        self.micro_batches = 1
        self.schedule = "1f1b"
        self.loss_reduction = "mean"
        self.split_inputs: tuple | None = None
        self.zero_stage = 0
        self.zero_min_size = 0

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Split the inputs into ``steps`` micro-batches (axis 0, balanced), accumulate their
        gradients, update once a call."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise GraphError(f"gradient accumulation steps must be an int >= 1, got {steps!r}")
        self.micro_batches = steps

    def set_pipeline_schedule(self, schedule: str) -> None:
        """``"1f1b"`` (default: stage s of S keeps at most S - s micro-batches' activations)
        or ``"gpipe"`` (all forwards, then all backwards)."""
        if schedule not in SCHEDULES:
            raise GraphError(f"unknown pipeline schedule {schedule!r}; one of {SCHEDULES}")
        self.schedule = schedule

    def set_loss_reduction(self, reduction: str) -> None:
        """``"mean"`` (default): a scalar output is a mean over the batch, so micro-batch m's
        loss and gradient are weighted by its share of the batch; ``"sum"``: weight 1."""
        if reduction not in ("mean", "sum"):
            raise GraphError(f"loss reduction must be 'mean' or 'sum', got {reduction!r}")
        self.loss_reduction = reduction

    def set_split_inputs(self, *flags: bool) -> None:
        """Which inputs of ``build`` are cut into micro-batches (default: the global tensors
        whose axis 0 has the first input's size); the others go whole to each micro-batch. A
        tuple, list or dict input holding global tensors counts as its leaves, in order."""
        self.split_inputs = tuple(bool(f) for f in flags)

    def enable_zero(self, stage: int = 2, *, min_size: int = 0) -> None:
        """ZeRO ``stage`` (1-3; 0: off) on the graph's modules' parameters along their
        data-parallel dims, applied in place at the first call (docs/zero.md, 'Graph mode'):
        the parameter objects, and so the optimizers built on them, stay the same.
        Parameters with fewer than ``min_size`` elements stay as they are."""
        self.zero_stage = check_stage(stage, "GraphConfig.enable_zero")
        self.zero_min_size = check_min_size(min_size, "GraphConfig.enable_zero")

    def __repr__(self) -> str:
        zero = f", zero_stage={self.zero_stage}" if self.zero_stage else ""
        return (f"GraphConfig(micro_batches={self.micro_batches}, schedule={self.schedule!r}, "
                f"loss_reduction={self.loss_reduction!r}{zero})")


class Graph:
    """Subclass it, register modules and optimizers in ``__init__``, write ``build``. Calling
    the graph runs one training step: ``build`` on each micro-batch (its ``backward()``), then
    each added optimizer's ``step()`` and ``zero_grad()``. Every rank calls it."""

    def __init__(self) -> None:
        self.config = GraphConfig()
        self._optimizers: list[tuple] = []
        self._compiled: dict[tuple, Compiled] = {}
        self._last: Compiled | None = None
        self._zero_done = (0, 0)   # the (stage, min_size) of ZeRO applied at the first call
        self._ran: dict[int, Module] = {}   # id -> a module whose forward a trace ran

    def add_optimizer(self, optimizer, lr_sch=None) -> None:
        """Run ``optimizer.step()``, ``optimizer.zero_grad()`` and ``lr_sch.step()`` after the
        micro-batches of each call."""
        if not hasattr(optimizer, "step") or not hasattr(optimizer, "zero_grad"):
            raise GraphError(f"add_optimizer needs an optimizer, got {type(optimizer).__name__}")
        if lr_sch is not None:
            _check_scheduler(lr_sch)
        self._optimizers.append((optimizer, lr_sch))
        self._compiled.clear()   # plans compiled before have no update: compile again

    def build(self, *inputs: Any) -> Any:
        raise GraphError(f"{type(self).__name__} must define build(self, *inputs)")

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        """One step on ``inputs`` (``build``'s arguments; keyword arguments are bound to its
        parameters by name)."""
        if named:
            inputs = _bound(self.build, type(self).__name__, inputs, named)
        settle()   # ZeRO-1 parameters gathered in the background since the last update
        self._apply_zero()
        flat, forms = flatten_inputs(inputs)   # (a tuple or dict of tensors: its leaves)
        key = self._key(flat, forms)
        compiled = self._compiled.get(key)
        if compiled is not None and compiled.uses_replaced():
            del self._compiled[key]   # the model holds new parameter objects: trace it again
            compiled = None
        if compiled is None:
            compiled = Compiled(self, flat, forms)
            self._ran.update(compiled.modules)
            self._compiled[self._key(flat, forms)] = compiled   # (with the modules it ran)
        self._last = compiled
        return compiled.run(flat)

    def _key(self, inputs: tuple, forms: tuple | None) -> tuple:
        """What a plan is compiled for besides the config: the inputs' shapes and layouts
        (``inputs``: the leaves, nested as ``forms`` say),
        the train / eval mode of every module a trace ran (dropout; a module reached through
        a closure or a list too) and of the registered ones, the registered modules
        themselves, torch's grad mode (under no_grad a build's backward raises, as on a first
        call) and autocast state (the dtype the traced ops compute in)."""
        attrs = [v for v in vars(self).values() if isinstance(v, Module)]
        modes = tuple(m.training for m in self._ran.values())
        modes += tuple((id(v), v.training) for v in attrs)
        modes += (torch.is_grad_enabled(),) + _autocast_state()
        cfg = self.config
        return (signature(inputs), forms, modes, cfg.micro_batches, cfg.schedule,
                cfg.loss_reduction, cfg.split_inputs)

    def _apply_zero(self) -> None:
        """`GraphConfig.enable_zero` on the registered modules, at the first call. Asked
        after it, it is refused: the parameters are laid out and the optimizers' state built
        for the first layout (a later compile applying it would mix the two)."""
        wanted = (self.config.zero_stage, self.config.zero_min_size)
        if wanted == self._zero_done:
            return
        if self._compiled:
            raise GraphError(f"{type(self).__name__}: config.enable_zero(stage={wanted[0]}, "
                             f"min_size={wanted[1]}) after the graph's first call (compiled "
                             f"with stage {self._zero_done[0]}, min_size {self._zero_done[1]}); "
                             f"set it in __init__, before the first call")
        for v in vars(self).values():
            if isinstance(v, Module):
                # (stage 2: the replay gathers in forward, no whole copies are kept)
                _zero_shard(v, wanted[0], wanted[1], keep_whole=False)
        self._zero_done = wanted

    # -- what a user reads ----------------------------------------------------------------------
    def _current(self) -> Compiled:
        if self._last is None:
            raise GraphError(f"{type(self).__name__} has not been called yet: call it once "
                             f"(which compiles it) first")
        return self._last

    def plan(self, rank: int | None = None) -> str:
        """The actors of ``rank`` (default: this rank) with their registers."""
        c = self._current()
        world = _comm.current().world_size
        if rank is not None and (type(rank) is not int or not 0 <= rank < world):
            raise GraphError(f"graph.plan: rank must be an int in 0 .. {world - 1} (the "
                             f"world's ranks), got {rank!r}")
        return c.plan.describe(_comm.rank() if rank is None else rank)

    def timeline(self) -> list[dict]:
        """The last call's firings on every rank (every rank calls it: the events are
        exchanged), ``{"rank", "actor", "kind", "stage", "micro_batch", "start", "end"}``,
        seconds on one clock from the first start."""
        return _gather_events(self._current())

    def save_timeline(self, path: str) -> None:
        """Draw the last call's Gantt chart (a row a rank); written by rank 0."""
        events = self.timeline()
        if _comm.rank() == 0:
            _save_timeline(events, path, title=f"{type(self).__name__}: "
                           f"{self.config.micro_batches} micro-batches, {self.config.schedule}")

    def save_trace(self, path: str) -> None:
        """The last call's Chrome trace (opens in Perfetto); written by rank 0."""
        events = self.timeline()
        if _comm.rank() == 0:
            _save_trace(events, path)

    def __repr__(self) -> str:
        if self._last is None:
            return f"{type(self).__name__}(not compiled yet; {self.config})"
        return f"{type(self).__name__}({self.config})\n{self._last.describe()}"


def _autocast_state() -> tuple:
    """The autocast dtype of the cpu and cuda device types (None where autocast is off)."""
    cpu = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    cuda = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    return cpu, cuda


def _check_scheduler(lr_sch: Any) -> None:
    """The graph calls ``lr_sch.step()`` after each update: refuse one whose ``step`` needs an
    argument (``ReduceLROnPlateau``'s metric)."""
    step = getattr(lr_sch, "step", None)
    if not callable(step):
        raise GraphError(f"add_optimizer: lr_sch must be a learning-rate scheduler (with "
                         f"step()), got {type(lr_sch).__name__}")
    needed = [p.name for p in inspect.signature(step).parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if needed:
        raise GraphError(f"add_optimizer: {type(lr_sch).__name__}.step needs {needed}, which "
                         f"the graph cannot give it; call lr_sch.step(...) yourself after each "
                         f"graph call and pass add_optimizer(optimizer) alone")


def _bound(build, name: str, inputs: tuple, named: dict) -> tuple:
    """``inputs`` and the keyword arguments ``named`` as ``build``'s positional arguments."""
    sig = inspect.signature(build)
    try:
        bound = sig.bind(*inputs, **named)
    except TypeError as exc:
        raise GraphError(f"{name}.build{sig}: {exc}") from None
    bound.apply_defaults()  # a default before a named argument: an input like the others
    if bound.kwargs:
        raise GraphError(f"{name}.build{sig}: keyword-only arguments {sorted(bound.kwargs)} "
                         f"are not graph inputs; make them positional")
    return bound.args


_TIMELINE_CHANNEL = "sbpflow.graph.timeline"


def _gather_events(c: Compiled) -> list[dict]:
    """Every rank's events of the last run, on the wall clock (the ranks of one machine share
    it; `time.perf_counter` is per process), from the earliest start."""
    comm = _comm.current()
    offset = time.time() - time.perf_counter()
    mine = [dict(e, start=e["start"] + offset, end=e["end"] + offset) for e in c.events()]
    c.timeline_calls += 1
    tag = (c.plan.name, c.timeline_calls)
    early = comm.per_rank.graph_timeline_early  # messages for a later call
    for r in range(comm.world_size):
        if r != comm.rank:
            comm.post(r, _TIMELINE_CHANNEL, (tag, mine))
    events = list(mine)
    want = comm.world_size - 1
    deadline = time.monotonic() + comm.wait_timeout()
    got = early.pop(tag, [])
    while len(got) < want:
        if time.monotonic() > deadline:
            raise GraphError(f"graph.timeline(): {want - len(got)} rank(s) did not send their "
                             f"events; every rank must call timeline() (or save_timeline)")
        for _, (t, evs) in comm.inbox(_TIMELINE_CHANNEL, 0.05):
            if t == tag:
                got.append(evs)
            else:
                early.setdefault(t, []).append(evs)
    for evs in got:
        events.extend(evs)
    t0 = min((e["start"] for e in events), default=0.0)
    return sorted((dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in events),
                  key=lambda e: (e["start"], e["rank"]))
