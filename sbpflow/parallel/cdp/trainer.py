"""``sf.parallel.CyclicDataParallel``: train N stages with N micro-batches a step on the
cyclic schedule, in one of five settings, on the actor runtime.

Every rank of the world builds the trainer (it reads the stages' initial values, a
collective) and calls `state_dict`, `stats` and `save_timeline` (collectives); the ranks of
the trainer's placement call `step` and `flush` (others may: it does nothing there). Each
`step` runs one window of ``2N`` time steps as one run of the runtime: the new cycle's first
ops and the previous cycle's last ones. See docs/cdp.md.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from ... import memory
from ...comm import current
from ...errors import CommAborted, PlanError, ShapeError
from ...placement import Placement, placement as make_placement
from ...runtime import Runtime
from ...tensor import GlobalTensor
from .schedule_figure import Drawn, draw_timeline
from .window_plan import window_plan
from .schedule_stats import Record, ScheduleLog, gather_schedule, run_tasks, summary
from .cycles import check_n
from .program import PeerTransfer, Work, cycle_tasks, shift, version_uses, window
from .rank_state import RankState
from .roles import make_roles, ranks_needed
from .rules import check_rule, timeline_of
from .stage_runner import StageRunner
from .stage_split import stage_list
from .version_store import StageOwner, VersionStore
from .window_measure import WindowMeasure

__all__ = ["CyclicDataParallel"]


def _trainer_id(comm) -> int:
    """The trainer's number on this rank: ranks build trainers in the same order, so it
    names the same trainer on every rank (its runtime channel and transfer stream)."""
    k = comm.per_rank.cdp_trainers
    comm.per_rank.cdp_trainers = k + 1
    return k


def _split_batch(t: torch.Tensor, n: int, what: str) -> list[torch.Tensor]:
    if t.dim() == 0 or t.shape[0] < n:
        raise PlanError(f"CyclicDataParallel.step: {what} must be a tensor whose axis 0 holds "
                        f"at least N = {n} samples (one micro-batch a worker), got "
                        f"shape {tuple(t.shape)}")
    return [p.clone() for p in torch.tensor_split(t.detach(), n)]


def _where(task: Work | PeerTransfer | None, aborted: bool, active: list, lo: int, span: int,
           c_ref: int) -> str:
    """Where a run failed (``aborted``: stopped by another rank's failure), in absolute
    cycles (training steps fed, from 0) and time steps: the runtime's messages name actors,
    whose names count cycles from the run's newest."""
    run = (f"CDP run of time steps {lo}..{lo + span - 1}, cycles {[c for c, _ in active]} "
           f"(actor names count cycles from {c_ref})")
    if task is None:
        return f"failed during the {run}"
    if isinstance(task, Work):
        who = "" if task.worker < 0 else f"w{task.worker}"
        what = (f"{task.kind}{task.stage}{who}c{task.cycle}: {_KIND_WORD[task.kind]} of "
                f"stage {task.stage}" + (f", worker {task.worker}" if who else ""))
    else:
        what = f"transfer of {task.payload} from rank {task.src} to rank {task.dst}"
    verb = "stopped (another rank failed) in" if aborted else "failed in"
    return (f"{verb} {what}, cycle {task.cycle} (training step {task.cycle}), time step "
            f"{task.step}, 0-based; {run}")


_KIND_WORD = {"F": "forward", "B": "backward", "A": "gradient sum", "U": "update"}


class CyclicDataParallel:
    """Cyclic Data Parallelism over ``stages`` (a list of ``sf.nn`` modules, or a Sequential
    cut by ``split``): ``rule`` "dp" | "v1" | "v2", ``mode`` "single" | "dp" | "pp" | "mp" |
    "zero" on the ranks of ``placement`` (default the first ranks of the world the mode
    needs). ``loss_fn(out, y)`` gives a micro-batch's mean loss (global tensors);
    ``optimizer(params)`` builds one stage's optimizer. ``split=(N, "flops")`` reads the
    shape and dtype of ``example_input`` (a batch such as ``step``'s ``x``).
    ``timeline_windows``: how many of the first windows keep every task's record for
    `save_timeline` (None: all, memory growing with the steps); `stats` reads counts kept
    for every step."""

    def __init__(self, stages, loss_fn: Callable, optimizer: Callable, rule: str = "v2",
                 mode: str = "single", placement: Placement | Sequence[int] | None = None,
                 split=None, example_input=None, timeline_windows: int | None = 5) -> None:
        check_rule(rule)
        if timeline_windows is not None and (not isinstance(timeline_windows, int)
                                             or isinstance(timeline_windows, bool)
                                             or timeline_windows < 0):
            raise PlanError(f"CyclicDataParallel: timeline_windows is a number of windows "
                            f">= 0 or None (keep all), got {timeline_windows!r}")
        self.comm = comm = current()
        modules = stage_list(stages, split, example_input)
        self.n = n = len(modules)
        check_n(n)
        self.rule, self.mode, self.timeline = rule, mode, timeline_of(rule)
        need = ranks_needed(mode, n, self.timeline)
        if placement is None:
            if need > comm.world_size:
                raise PlanError(f"CDP mode {mode!r} with N = {n} needs {need} ranks; the world "
                                f"has {comm.world_size} (launch with world_size={need})")
            ranks, device = list(range(need)), "cpu"
        elif isinstance(placement, Placement):
            ranks, device = list(placement.flat_ranks), placement.device_type
        else:
            ranks, device = [int(r) for r in placement], "cpu"
        self.roles = make_roles(mode, n, self.timeline, ranks)
        self.runners = [StageRunner(m, j) for j, m in enumerate(modules)]
        first = [r.initial() for r in self.runners]  # a collective, on every rank
        self.uid = _trainer_id(comm)
        self.name = f"cdp{self.uid}"
        self.fed, self.window, self.pending = 0, 0, {}   # pending: cycle -> its first step
        self.schedule = ScheduleLog(None if timeline_windows is None
                                    else timeline_windows * 2 * n)
        self.plans: dict = {}
        self.plan_tasks: dict = {}  # id of a plan in ``plans`` -> its tasks (`_log_run`)
        self.broken: str | None = None
        self.rank = comm.rank
        self.state = None
        if self.rank in self.roles.ranks:
            self._setup(first, loss_fn, optimizer, device)

    def _setup(self, first: list, loss_fn: Callable, optimizer: Callable, device: str) -> None:
        if not callable(optimizer) or hasattr(optimizer, "param_groups"):
            raise PlanError(f"CyclicDataParallel: optimizer is a function of a stage's "
                            f"parameters that makes its optimizer (e.g. lambda ps: "
                            f"sf.optim.SGD(ps, lr=0.1)), got {type(optimizer).__name__}")
        n, roles, me = self.n, self.roles, self.rank
        pl = make_placement(device, [me])
        store = VersionStore(n, lambda j, v: version_uses(n, self.rule, roles, me, j, v))
        self.shape_cache: dict = {}
        self.state = RankState(me, n, self.rule, roles, self.runners, loss_fn, pl, store,
                               self._shape, self._stream)
        self.device = dev = self.comm.device(device)
        for j in range(n):
            tensors = self.runners[j].version([t.to(dev) for t in first[j]])
            if me in roles.holders(j):
                store.put(j, 0, tensors)
            if roles.owner(j) == me:
                self.state.owners[j] = StageOwner(tensors, pl, n, optimizer,
                                                  self.runners[j].nparams)
        self.state.sample()
        self.tracker = self.state.tracker = memory.Tracker(me)
        self.measuring = WindowMeasure()
        self.runtime = Runtime(window_plan(self.name, me, roles.ranks, [], [],
                                                 self.state))
        works, moves = cycle_tasks(0, 0, n, self.rule, roles)
        self.span = max(t.step for t in list(works) + list(moves)) + 1

    def _stream(self) -> str:
        return f"{self.name}/p2p/{self.runtime.failures}"

    def _shape(self, cycle: int, worker: int, stage: int) -> tuple:
        """Shape and dtype of stage ``stage``'s output for ``worker``'s micro-batch."""
        x = self.state.batches[cycle][0][worker]
        key = (tuple(x.shape), x.dtype)
        out = self.shape_cache.get(key)
        if out is None:
            out, shape, dtype = [], key[0], key[1]
            for r in self.runners[:-1]:
                shape, dtype = r.probe(shape, dtype, self.state.pl)
                out.append((shape, dtype))
            self.shape_cache[key] = out
        return out[stage]

    # -- running windows ------------------------------------------------------------------------
    def _plan(self, active: list[tuple[int, int]], lo: int):
        c_ref = max(c for c, _ in active)
        period = self.roles.period
        key = (tuple((c - c_ref, base - lo) for c, base in active), c_ref % period,
               c_ref if c_ref < 2 else -1)
        plan = self.plans.get(key)
        if plan is None:
            works, moves = window(active, lo, lo + 2 * self.n, self.n, self.rule, self.roles)
            works = [shift(t, -c_ref, -lo) for t in works]
            moves = [shift(t, -c_ref, -lo) for t in moves]
            plan = self.plans[key] = window_plan(self.name, self.rank, self.roles.ranks,
                                                 works, moves, self.state)
        return plan, c_ref

    def _run(self, active: list[tuple[int, int]]) -> None:
        if self.broken:
            raise PlanError(f"CyclicDataParallel: {self.broken}; build a new trainer")
        lo = 2 * self.n * self.window
        plan, c_ref = self._plan(active, lo)
        st = self.state
        st.ctx, st.log, st.failed = (c_ref, lo), {}, None
        for r in self.runners:
            r.cache_modes(True)  # (read anew: the caller may have changed them)
        try:
            self._execute(plan, active, lo, c_ref)
        finally:
            for r in self.runners:
                r.cache_modes(False)
        self._log_run(plan, c_ref, lo)
        self.window += 1
        hi = lo + 2 * self.n
        for c in [c for c, base in active if base + self.span <= hi]:
            del self.pending[c]
            st.batches.pop(c, None)
            self.measuring.retire(c)

    def _log_run(self, plan, c_ref: int, lo: int) -> None:
        """Add the run's F, B and U tasks to the schedule log: from the timeline while the log
        keeps records, else the plan's tasks summed once (`run_tasks`: the same counts)."""
        log = self.state.log  # (tasks relative to the run: c_ref, lo)
        if not self.schedule.keeps(lo):
            tasks = self.plan_tasks.get(id(plan))
            if tasks is None:
                tasks = self.plan_tasks[id(plan)] = run_tasks(
                    (t.kind, t.worker, t.stage, t.cycle, t.step) for t, _ in log.values()
                    if getattr(t, "kind", None) in ("F", "B", "U"))
            self.schedule.add_run(tasks, c_ref, lo)
            return
        add = self.schedule.add
        for e in self.runtime.timeline():
            task, v = log.get(e["actor"], (None, -1))
            if task is not None and getattr(task, "kind", None) in ("F", "B", "U"):
                add(task.kind, task.worker, task.stage, task.cycle + c_ref, task.step + lo, v,
                    self.rank, e["start"], e["end"])

    def _execute(self, plan, active: list[tuple[int, int]], lo: int, c_ref: int) -> None:
        """Run ``plan``: the window of cycles ``active`` from time step ``lo``, measured or not
        (`window_measure`); a failure leaves the trainer broken."""
        st = self.state
        modes = tuple(r.modes(self.device.type) for r in self.runners)
        st.measure = self.measuring.starts(plan, active, modes)
        st.replayed_all = True
        if st.measure and not self.measuring.before:  # (after a run that did not measure)
            st.adopt_live()
        try:
            with memory.attach([self.tracker]) if st.measure else contextlib.nullcontext():
                self.runtime.run(1, plan=plan)
        except BaseException as exc:
            where = _where(st.failed, isinstance(exc, CommAborted), active, lo, 2 * self.n,
                           c_ref)
            if hasattr(exc, "add_note"):
                exc.add_note(where)
            self.broken = (f"a run failed mid-schedule ({type(exc).__name__}: {exc}; {where}), "
                           f"leaving its cycles half done")
            raise
        self.measuring.ended(st.measure, st.replayed_all)

    def step(self, x, y) -> list[tuple[int, int, float]]:
        """Feed one global batch (``x``, ``y``: axis 0 cut into N micro-batches, worker ``i``
        the ``i``-th) and run one window. Returns the losses this rank finished during the
        call, as ``(step, worker, value)``."""
        # global tensors: gathered on every rank first (a collective; a rank outside the
        # trainer returns right after)
        x, y = (t.full_tensor() if isinstance(t, GlobalTensor) else t for t in (x, y))
        for t, what in ((x, "x"), (y, "y")):
            if not isinstance(t, torch.Tensor):
                raise PlanError(f"CyclicDataParallel.step: {what} must be a torch tensor or a "
                                f"global tensor, got {type(t).__name__}")
        nx, ny = x.shape[:1], y.shape[:1]
        if nx and ny and nx != ny:
            raise ShapeError(f"CyclicDataParallel.step: x holds {nx[0]} samples on axis 0 and "
                             f"y {ny[0]} (x {tuple(x.shape)}, y {tuple(y.shape)}); they need "
                             f"a row a sample, so that both cut into the same N = {self.n} "
                             f"micro-batches")
        if self.state is None:
            return []
        xs = [t.to(self.device) for t in _split_batch(x, self.n, "x")]
        ys = [t.to(self.device) for t in _split_batch(y, self.n, "y")]
        c = self.fed
        self.state.batches[c] = (xs, ys)
        self.measuring.fed(c, xs + ys)
        self.pending[c] = 2 * self.n * self.window
        self.fed += 1
        return self._finish(lambda: self._run(sorted(self.pending.items())))

    def flush(self) -> list[tuple[int, int, float]]:
        """Finish the steps in flight (their updates applied); returns their losses."""
        if self.state is None or not self.pending:
            return []

        def drain():
            while self.pending:
                self._run(sorted(self.pending.items()))
        return self._finish(drain)

    def _finish(self, run: Callable) -> list:
        losses = self.state.losses
        losses.clear()  # (a failed run's are not returned)
        run()
        out = sorted((c, i, float(v)) for c, i, v in losses)
        losses.clear()
        return out

    @property
    def records(self) -> list[Record]:
        """This rank's record of every task of the first ``timeline_windows`` windows."""
        return self.schedule.records

    # -- collectives: every rank of the world calls them ----------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The latest parameters (each stage's last update applied), logical values keyed
        ``"{stage}.{name}"``, on every rank (a broadcast from each stage's owner)."""
        group = list(range(self.comm.world_size))
        out = {}
        for j, r in enumerate(self.runners):
            owner = self.roles.owner(j)
            if self.rank == owner:
                store = self.state.store
                tensors = [t.detach() for t in store.peek(j, store.latest(j))]
            else:
                tensors = [torch.empty(s, dtype=d) for s, d in zip(r.shapes, r.dtypes)]
            for name, t in zip(r.names, tensors):
                out[f"{j}.{name}"] = self.comm.broadcast(t.contiguous(), owner, group)
        return out

    def _gather(self):
        st = self.state
        if st is None:
            counters = [0.0] * (6 + self.n)
        else:
            counters = [1.0, st.messages, st.nbytes, self.tracker.peak, self.fed,
                        st.param_peak, *st.store.max_versions]
        return gather_schedule(self.comm, self.schedule if st else None, counters)

    def stats(self) -> dict:
        """Peak live activations (micro-batch x stage units, from the executed time steps),
        measured activation bytes (tensors saved for backward, largest rank), parameter and
        optimizer-state bytes held (largest rank), the most versions of each stage held at
        once, messages and bytes sent per step, the most
        gradient chunks made in one time step, the idle fraction of the ranks' op slots.
        A collective: every rank of the world calls it."""
        schedule, counters = self._gather()
        return summary(schedule, counters, self.n, self.roles.ranks)

    def save_timeline(self, path: str, steps: tuple[int, int] | None = None) -> Drawn | None:
        """Draw the executed schedule to ``path`` (rank 0 writes it; a collective): time
        steps ``steps``, ``(first, end)`` (default the ``timeline_windows`` windows of ``2N``
        steps whose records are kept, or five with all kept). Rank 0 gets what the figure
        holds (`Drawn`), other ranks None."""
        keep = self.schedule.keep
        steps = steps or (0, 2 * self.n * 5 if keep is None else keep)
        if keep is not None and steps[1] > keep:
            raise PlanError(f"CyclicDataParallel.save_timeline: steps {tuple(steps)} reach "
                            f"past the {keep} time steps whose records the trainer keeps (its "
                            f"first {keep // (2 * self.n)} windows of 2N = {2 * self.n}); "
                            f"build it with a larger timeline_windows, or None to keep all")
        schedule, _ = self._gather()
        records = schedule.records
        if self.rank != 0:
            return None
        rows_by = "worker" if self.mode == "single" else "rank"
        return draw_timeline(records, path, rows_by, f"CDP rule {self.rule}, mode "
                             f"{self.mode}, N = {self.n} (ranks {list(self.roles.ranks)})",
                             steps)
