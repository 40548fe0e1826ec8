"""One compiled graph: the tapes of its micro-batch shapes, their stages, the runtime plan.

Compiling traces ``build`` once per distinct micro-batch shape (balanced micro-batches have at
most two); each trace runs the forward eagerly (its ``backward()`` is recorded, not run), so
compiling costs about one forward a shape. A call then splits the inputs, runs the plan on the
actor runtime, and assembles the outputs: with one micro-batch the values themselves, with
several each scalar output as the weighted sum of the micro-batches' (the batch mean of a mean
loss; non-scalar outputs are refused). See docs/runtime.md, 'Graph mode'.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .. import comm as _comm
from ..boxing import empty_local
from ..errors import GraphError
from ..nn.graph_count_mean import CountedMean, scale_grads, settle_means, upstream_scale
from ..param_state import replaced_by, replaced_version
from ..runtime import Runtime
from ..tensor import GlobalTensor, set_recorder
from ..utils import rebuild_sequence, text_digest
from .lower import lower, reads, stages_of, writes
from .microbatch import signature, split_inputs, unflatten_inputs
from .nodes import Env, source_values
from .plan import GraphCall, graph_plan, quiet_stages
from .show import describe
from .recorder import OutConst, OutSlot, Recorder, Tape

__all__ = ["Compiled", "trace"]


def trace(graph, args: list, rec: Recorder, forms: tuple | None = None) -> Tape:
    """Run ``graph.build(*args)`` eagerly with ``rec`` recording on this thread (``args``
    nested as ``forms`` say, `unflatten_inputs`). The default seed stream is wound back after:
    the calls make the draws (the first call's are the ones an eager step would have made)."""
    for a in args:
        rec.add_input(a)
    state = _comm.current().per_rank
    counter = state.seed_counter
    previous = set_recorder(rec)
    try:
        result = graph.build(*unflatten_inputs(forms, args))
    finally:
        set_recorder(previous)
        state.seed_counter = counter
        rec.restore()   # the first call's replay writes the buffers build writes
    return rec.tape(result)


def _tell_readers(tape: Tape) -> None:
    """Tell each task that asks (``read_by_tasks``) whether other tasks read what it writes."""
    read = {s for node in tape.nodes for s in reads(node)}
    for node in tape.nodes:
        tell = getattr(node, "read_by_tasks", None)
        if tell is not None:
            tell(any(s in read for s in writes(node)))


def _correct_upstream(tapes: list, stages: int) -> bool:
    """Whether the stages before a pipeline's mean over micro-batches (`CountedMean`) scale
    their gradients by its correction: when it is the only such mean and the only loss backward
    starts from (their gradients are then all its own). Tells the means."""
    means = [n for t in tapes for n in t.nodes
             if isinstance(n, CountedMean) and n.index is not None]
    ok = stages > 1 and bool(tapes[0].backwards) and all(
        len(t.backwards) == 1 and sum(n.index is not None for n in t.nodes
                                      if isinstance(n, CountedMean)) == 1 for t in tapes)
    for n in means:
        n.corrected_upstream(ok)
    return ok


def _mean_stage(low) -> int | None:
    """The stage of the pipelined mean over micro-batches of lowered tape ``low``."""
    for s, nodes in sorted(low.forward.items()):
        if any(isinstance(n, CountedMean) and n.index is not None for n in nodes):
            return s
    return None


class Compiled:
    """``graph`` compiled for inputs like ``inputs`` (same shapes, dtypes, layouts; the
    leaves of build's arguments, nested as ``forms`` say: `flatten_inputs`)."""

    def __init__(self, graph, inputs: tuple, forms: tuple | None = None) -> None:
        cfg = graph.config
        self.graph, self.k, self.cfg = graph, cfg.micro_batches, cfg
        self.comm = _comm.current()
        mbs = split_inputs(inputs, self.k, cfg.split_inputs)
        self.batches: list = []  # what data sources in build gave while compiling
        self.tapes: dict[tuple, Tape] = {}
        self.keys: list[tuple] = []  # micro-batch m's tape
        self.modules: dict[int, Any] = {}   # id -> a module whose forward build ran
        self.replaced = replaced_version()
        for m, args in enumerate(mbs.args):
            key = (signature(args), self._source_shapes(m))
            if key not in self.tapes:
                rec = Recorder(m, self.k, self.batches, self.k > 1 and cfg.loss_reduction == "mean")
                tape = trace(graph, args, rec, forms)
                self.modules.update(rec.modules)
                key = (signature(args), self._source_shapes(m))  # the sources are known now
                self.tapes.setdefault(key, tape)
                _tell_readers(tape)
            self.keys.append(key)
        self.weights = self._weights(mbs.sizes)
        tapes = list(self.tapes.values())
        self.stages = stages_of(tapes[0])
        for t in tapes[1:]:
            if stages_of(t) != self.stages:
                raise GraphError("graph: micro-batches of different sizes use different stages")
        # a pipelined mean's correction reaches the earlier stages (Megatron hands its token
        # count to every stage the same way): a runtime message before their update
        exchange = _correct_upstream(tapes, len(self.stages))
        self.lowered = {sig: lower(t, self.stages) for sig, t in self.tapes.items()}
        self.lowered_list = [self.lowered[key] for key in self.keys]   # micro-batch m's
        self.draws = sum(low.tape.draws for low in self.lowered_list)   # a call's draws
        self._check_ranks_agree(self.lowered[self.keys[0]])
        self._check_outputs(tapes[0])
        pls = tapes[0].placements()
        self.env = Env(self.comm, pls[0].device_type if pls else "cpu")
        self.comm.per_rank.graph_plans += 1  # the same count on every rank
        first = self.lowered[self.keys[0]]
        self.call: GraphCall | None = None
        self.plan = graph_plan(first, self.stages, self.env, lambda: self.call, self.k,
                               cfg.schedule, bool(graph._optimizers),
                               name=f"graph{self.comm.per_rank.graph_plans}",
                               failures=lambda: self.runtime.failures if self.runtime else 0,
                               scale_stage=_mean_stage(first) if exchange else None,
                               quiet=quiet_stages(list(self.lowered.values())))
        self.runtime = Runtime(self.plan, self.comm) if self.comm.rank in self.plan.actors \
            else None
        self.timeline_calls = 0
        # the parameters of a training graph this rank holds no shard of (another stage's):
        # `_fill_off_rank_grads` gives them the empty gradient shard eager backward gives them
        # ([parameter, its shard, that shard's empty gradient], the last two made on first use)
        self.off_rank_params = [] if not tapes[0].backwards else [
            [t, None, None] for _, t in tapes[0].externals if isinstance(t, GlobalTensor)
            and t.shard.requires_grad and t.shard.is_leaf and self.comm.rank not in t.placement]

    def uses_replaced(self) -> bool:
        """Whether a parameter the plan reads was replaced since it was compiled (by
        ``sf.parallel.apply`` and the like: the model now holds new objects)."""
        version = replaced_version()
        if version == self.replaced:
            return False
        self.replaced = version
        return any(replaced_by(t) for tape in self.tapes.values() for _, t in tape.externals
                   if isinstance(t, GlobalTensor))

    def _check_ranks_agree(self, low) -> None:
        """Every rank traced the whole program and lowered it alone: check (one small
        all-gather) that they found the same stages and transfers, so a disagreement is a
        `GraphError` naming it, not a hang."""
        shape = (tuple(sorted(r) for r in self.stages),
                 tuple((t.src_stage, t.dst_stage, t.meta.shape, str(t.meta.dtype), t.grad)
                       for t in low.transfers),
                 tuple(len(low.backwards[s]) for s in sorted(low.backwards)))
        digest = text_digest(repr(shape))
        world = tuple(range(self.comm.world_size))
        if len(world) == 1:
            return
        got = self.comm.gather_ints([digest], world)
        differ = [r for r, (d,) in zip(world, got) if d != digest]
        if differ:
            raise GraphError(f"graph: ranks {differ} lowered build to other stages or transfers "
                             f"than rank {self.comm.rank} ({len(self.stages)} stages, "
                             f"{len(low.transfers)} transfers here); build must run the same "
                             f"ops on every rank")

    def _split_batch(self, batch: Any):
        """A batch a data source gave, cut into the micro-batches (all its values)."""
        values = source_values(batch)
        return split_inputs(values, self.k, [True] * len(values))

    def _source_shapes(self, m: int) -> tuple:
        """The shapes of micro-batch m's rows of each batch data sources gave."""
        return tuple(tuple(tuple(v.shape) for v in self._split_batch(b).args[m])
                     for b in self.batches)

    def _weights(self, sizes: list | None) -> list[float]:
        """Each micro-batch's loss weight: its share of the batch (mean losses), else 1."""
        if sizes is None and self.batches:
            sizes = self._split_batch(self.batches[0]).sizes
        if self.k == 1:
            return [1.0]
        if sizes is None:
            raise GraphError(f"graph: {self.k} micro-batches but nothing to split: no input of "
                             f"build has the batch on axis 0 (see config.set_split_inputs) and "
                             f"build reads no data source")
        if self.cfg.loss_reduction == "sum":
            return [1.0] * self.k
        total = sum(sizes)
        return [n / total for n in sizes]

    def _check_outputs(self, tape: Tape) -> None:
        if self.k == 1:
            return
        big = [tape.metas[s].shape for s in tape.outs if tape.metas[s].shape != ()]
        if big:
            raise GraphError(f"graph: with {self.k} micro-batches build may return only "
                             f"scalars (combined as the batch's weighted mean), not tensors of "
                             f"shapes {big}; return them from a graph without gradient "
                             f"accumulation")
        # (a weighted mean of counts is neither the batch's count nor of their dtype)
        ints = [str(tape.metas[s].dtype) for s in tape.outs
                if not (tape.metas[s].dtype.is_floating_point or tape.metas[s].dtype.is_complex)]
        if ints:
            raise GraphError(f"graph: with {self.k} micro-batches build returns scalars of "
                             f"{ints}, which the graph would combine as the micro-batches' "
                             f"weighted mean ({self.cfg.loss_reduction!r} reduction); return "
                             f"a floating-point mean instead (a count c of n rows: "
                             f"c.double() / n, or with set_loss_reduction('sum'), c.double())")

    # -- a call ---------------------------------------------------------------------------------
    def run(self, inputs: tuple) -> Any:
        if self.k == 1:   # (split_inputs gives one micro-batch of the inputs themselves)
            shards = [[a.shard if isinstance(a, GlobalTensor) else None for a in inputs]]
        else:
            shards = [[a.shard if isinstance(a, GlobalTensor) else None for a in args]
                      for args in split_inputs(inputs, self.k, self.cfg.split_inputs).args]
        lowered = self.lowered_list
        # the first call trains on the batches the sources gave while compiling
        preloaded, self.batches = self.batches, []
        state = self.comm.per_rank
        base = state.seed_counter
        means: dict = {}
        self.call = GraphCall(shards, lowered, self.weights, {}, self._sync, self._update,
                              preloaded, base, means, lambda: upstream_scale(means))
        try:
            results = self.runtime.run(self.k) if self.runtime is not None else {}
            settle_means(self.call.means)   # (a graph without backward: the values only)
            if not self.graph._optimizers:  # the gradients stay after the call
                self._take_scale(results.get("scale<", [None])[0])
                self._fill_off_rank_grads()
            # every rank's stream goes on after the call's draws, whichever stage made them
            state.seed_counter = base + self.draws
            tape = lowered[0].tape
            return self._assemble(tape.outputs, self.call, iter(range(len(tape.outs))))
        except BaseException:
            # the micro-batches whose backward ran left gradients: a failed call is no step
            for opt, _ in self.graph._optimizers:
                opt.zero_grad()
            raise
        finally:
            # free the batch (the call's own containers: a thread a failed run left behind
            # may still read the call)
            self.call.inputs.clear()
            self.call.outputs.clear()

    def _sync(self, mb: int):
        """No gradient all-reduce but in the last micro-batch's backward."""
        if mb == self.k - 1:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        for opt, _ in self.graph._optimizers:
            if hasattr(opt, "no_sync"):
                stack.enter_context(opt.no_sync())
        return stack

    def _fill_off_rank_grads(self) -> None:
        """Another stage's parameters get their empty gradient shard on this rank, as in eager
        mode: an optimizer then keeps state for every parameter on every rank (a checkpoint
        saves the same tensors everywhere), and ``p.grad`` reads alike on every rank. Each
        one's empty tensor is made once and given again while the shard is the same tensor
        (a ``zeros_like`` a parameter every call was a fifth of a pipeline stage's update;
        with no element, nothing written to it persists)."""
        for entry in self.off_rank_params:
            shard = entry[0].shard
            if shard.grad is not None:
                continue
            if entry[1] is not shard:
                entry[1:] = [shard, torch.zeros_like(shard)]
            shard.grad = entry[2]

    def _take_scale(self, got: list | None) -> None:
        """The correction the stage of a pipelined mean over micro-batches made, handed to
        this rank's stage (``got``: each of its ranks' ``(scale, held)``, from the plan's
        ``scale<``; None on that stage or without one): the gradients scaled by it, as that
        stage scaled its own (`graph_count_mean.scale_grads`)."""
        if not got:
            return
        holders = sum(1 for _, held in got if held)
        total = sum(scale for scale, held in got if held)
        if holders and total / holders != 1.0:
            scale_grads([p for _, p in self.tapes[self.keys[0]].externals
                         if isinstance(p, GlobalTensor)], total / holders)

    def _update(self, scales: list | None = None) -> None:
        self._take_scale(scales)
        self._fill_off_rank_grads()
        for opt, sch in self.graph._optimizers:
            opt.step()
            opt.zero_grad()
            if sch is not None:
                sch.step()

    def _assemble(self, template: Any, call: GraphCall, index) -> Any:
        """The outputs, ``index`` counting the tensors in template order (each micro-batch's
        tape has its own slots: the i-th tensor output of each is combined)."""
        if isinstance(template, OutSlot):
            return self._output(template.slot, next(index), call)
        if isinstance(template, OutConst):
            return template.value
        if isinstance(template, dict):
            return {k: self._assemble(v, call, index) for k, v in template.items()}
        return rebuild_sequence(template, [self._assemble(v, call, index) for v in template])

    def _output(self, slot: int, i: int, call: GraphCall) -> GlobalTensor:
        meta = self.lowered_list[0].tape.metas[slot]
        if self.k == 1:
            local = call.outputs[0][i] if 0 in call.outputs else None
        else:
            parts = [call.outputs[m][i] if m in call.outputs else None for m in range(self.k)]
            local = None if any(p is None for p in parts) else \
                sum(p * w for p, w in zip(parts, call.weights))
        if local is None:  # computed on another stage
            local = empty_local(meta.dtype, self.comm.device(meta.placement.device_type))
        return GlobalTensor(local, meta.shape, meta.placement, meta.sbp)

    # -- what the graph shows -----------------------------------------------------------------
    def events(self) -> list[dict]:
        return self.runtime.timeline() if self.runtime is not None else []

    def describe(self) -> str:
        return describe(self.graph, next(iter(self.lowered.values())), self.stages, self.k)
