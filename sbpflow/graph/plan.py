"""The actors of a lowered graph: what each rank runs for one call of the graph.

Per rank of stage s (all ranks of a stage run the same actors): ``fwd`` runs the micro-batch's
tasks and keeps its slots (activations, autograd graph) in register ``saved``, whose slot count
is the schedule (`sbpflow.runtime.activation_slots`: 1F1B S - s, GPipe M); ``send>t`` /
``recv<p`` move values between stages, one actor a pair of stages, each on its own thread (a
recv waiting never blocks a send); ``bwd`` runs ``torch.autograd.backward`` from the stage's
loss seeds and the gradients ``gradrecv<t`` got, and ``gradsend>p`` sends its inputs' gradients
back; ``flush`` (GPipe) holds the backwards until the last forward; ``grads`` then ``update``
run each optimizer's ``step()`` and ``zero_grad()`` after the last backward. Values cross ranks
inside transfers (the transfer step's point-to-point exchange); the one register read on other
ranks is ``scale``, the correction of a pipelined mean its stage hands the others' ``scale<``
(a runtime message, no collective). See docs/runtime.md, 'Graph mode'.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from ..boxing import dual_step, empty_local, run_step, whole_message
from ..comm import set_collective_stream
from ..errors import GraphError
from ..nn.graph_count_mean import settle_means
from ..zero.unit_tasks import abandon as abandon_units
from ..runtime import ActorSpec, Input, Plan, activation_slots
from ..sbp import local_shape
from .lower import Lowered
from .microbatch import split_inputs
from .nodes import AssignNode, DetachNode, Env, OpNode, ThunkNode, run_nodes, source_values
from .replay import programs_enabled, segment_program

__all__ = ["GraphCall", "graph_plan"]


class GraphCall(NamedTuple):
    """What one call of the graph hands the actors: per micro-batch its input shards, its tape's
    lowering and its loss weight; ``outputs`` is filled by the forward that holds them;
    ``sync(mb)`` is the context a backward runs in (``no_sync`` but for the last); ``update``
    runs the optimizers, given the ``(scale, held)`` the stage of a pipelined mean handed this
    rank (`scale_actors`; None on that stage or without one); ``upstream()`` is that stage's
    own pair (`graph_count_mean.upstream_scale`)."""

    inputs: list
    lowered: list
    weights: list
    outputs: dict
    sync: Callable[[int], Any]
    update: Callable[[list | None], None] | None
    preloaded: list          # batches the data sources gave while compiling (first call)
    draw_base: int           # where the call's random draws start in the default seed stream
    means: dict              # the call's means over micro-batches (`graph_count_mean._Shares`)
    upstream: Callable[[], tuple] = lambda: (1.0, False)


class _StageActors:
    """The functions of the actors of stage ``s`` on this rank, reading the current `GraphCall`."""

    def __init__(self, s: int, env: Env, call: Callable[[], GraphCall], first: Lowered) -> None:
        self.s, self.env, self.call = s, env, call
        self.sources = sorted({t.src_stage for t in first.into(s)})
        self.targets = sorted({t.dst_stage for t in first.out_of(s)})
        self.grad_from = [t for t in self.targets if any(x.grad for x in first.out_of(s, t))]
        self.grad_to = [p for p in self.sources if any(x.grad for x in first.into(s, p))]
        self.loads = bool(first.sources[s])
        self.blanks: dict = {}  # (dtype, device type) -> the empty input of a receive
        # id(lowering) -> (the lowering, its forward segment as one program: `segment_program`)
        self.programs: dict = {}

    def program(self, low: Lowered) -> Callable:
        """The forward segment of this stage in lowering ``low`` as one call ``run(vals, env)``
        (made on first use; the walk `run_nodes` when programs are off)."""
        got = self.programs.get(id(low))
        if got is None:
            nodes, frees = low.forward[self.s], low.frees[self.s]
            fn = segment_program(nodes, frees, f"stage {self.s}") if programs_enabled() else \
                (lambda vals, env: run_nodes(nodes, vals, env, frees))
            got = self.programs[id(low)] = (low, fn)
        return got[1]

    def load(self, mb: int) -> list:
        """Each data source's next batch, cut into the call's micro-batches: per source, per
        micro-batch, the shards (`GraphError` when a batch's shape or layout changed)."""
        c = self.call()
        k = len(c.lowered)
        out = []
        for node in c.lowered[0].sources[self.s]:
            batch = c.preloaded[node.index] if c.preloaded else node.load()
            values = source_values(batch)
            got = tuple((tuple(v.shape), v.dtype, v.placement, v.sbp) for v in values)
            if got != node.metas:
                raise GraphError(f"graph: data source {node.index} gave a batch of "
                                 f"{[g[0] for g in got]} where the compiled plan has "
                                 f"{[m[0] for m in node.metas]} (a last smaller batch?); "
                                 f"use drop_last=True, or call the graph with the batch")
            mbs = split_inputs(values, k, [True] * len(values))
            out.append([tuple(t.local for t in args) for args in mbs.args])
        return out

    def forward(self, mb: int, *inputs: list) -> list:
        """Inputs: the values received from each source stage, then (a stage with data
        sources) the loaded batches' micro-batches."""
        c = self.call()
        low = c.lowered[mb]
        vals = low.tape.new_vals(c.inputs[mb]) + [None] * (low.nslots - low.tape.nslots)
        received = []
        for p, locals_ in zip(self.sources, inputs):
            for t, local in zip(low.into(self.s, p), locals_):
                vals[t.out] = local
                received.append(id(local))
        if self.loads:
            for node, pieces in zip(low.sources[self.s], inputs[len(self.sources)]):
                for slot, local in zip(node.outs, pieces[mb]):
                    vals[slot] = local
        env = Env(self.env.comm, self.env.device_type, c.draw_base + mb * low.tape.draws,
                  c.weights[mb], c.means, frozenset(received))
        try:
            self.program(low)(vals, env)
        except BaseException:
            abandon_units()   # ZeRO's unit calls left open: their saved-tensor hooks
            raise
        # the caller reads the outputs this stage computed (detached: the activations of the
        # micro-batch are freed by its backward, not kept until the call ends)
        c.outputs[mb] = [None if vals[k] is None else vals[k].detach()
                         for k in low.tape.outs]
        return vals

    # (no ``torch.no_grad()`` around a send or a receive: no tensor of theirs requires grad,
    # the value sent being detached and a receive's input `_received`'s empty one, so autograd
    # records nothing anyway, and entering the context costs each message a few Python calls)
    def send(self, t: int) -> Callable:
        def send(mb: int, vals: list) -> None:
            for x in self.call().lowered[mb].out_of(self.s, t):
                self._sent(x.step, vals[x.src].detach())
        return send

    def _message(self, step) -> tuple | None:
        """`whole_message` of ``step`` on this rank: its part is one message of a whole shard,
        which the communicator's ``send`` / ``recv`` move with none of `run_step`'s general
        work (a fifth of a transfer's CPU). None also while boxing steps are recorded
        (`record_steps`: `run_step` records them)."""
        comm = self.env.comm
        if comm.per_rank.boxing_trace is not None:
            return None
        return whole_message(step, comm.rank)

    def _sent(self, step, value: torch.Tensor) -> None:
        """This rank's part of transfer ``step``, which sends ``value``."""
        how = self._message(step)
        if how is None:
            run_step(step, value, self.env.comm)
        else:
            self.env.comm.send(value.contiguous(), how[1])  # (as run_step sends it)

    def recv(self, p: int) -> Callable:
        def recv(mb: int) -> list:
            out = []
            for x in self.call().lowered[mb].into(self.s, p):
                local = self._received(x)
                out.append(local.requires_grad_(True) if x.grad else local)
            return out
        return recv

    def _received(self, x, step=None) -> torch.Tensor:
        """This rank's value of transfer ``x`` (``step``: its step, default ``x.step``), which it
        receives: the step's input is an empty tensor of the value's dtype and device, made
        once (a receiver's input is read for its dtype and device only). A step that would
        give back that input itself gets a new one, so the shared tensor is never handed on."""
        step = x.step if step is None else step
        how = self._message(step)
        if how is not None:
            comm = self.env.comm
            return comm.recv(how[2], x.meta.dtype, how[1],
                             comm.device(step.dst_placement.device_type))
        key = (x.meta.dtype, x.meta.placement.device_type)
        blank = self.blanks.get(key)
        if blank is None:
            blank = self.blanks[key] = _empty(x, self.env)
        local = run_step(step, blank, self.env.comm)
        return _empty(x, self.env) if local is blank else local

    def backward(self, mb: int, vals: list, *rest: Any) -> dict:
        c = self.call()
        low, w = c.lowered[mb], c.weights[mb]
        tensors, grads = [], []
        for b in low.backwards[self.s]:
            tensors.append(vals[b.loss])
            seed = b.seed(vals)
            grads.append(seed if w == 1.0 else seed * w)
        for t, received in zip(self.grad_from, rest):
            for x, g in zip([x for x in low.out_of(self.s, t) if x.grad], received):
                if vals[x.src].requires_grad:
                    tensors.append(vals[x.src])
                    grads.append(g)
        if tensors:
            with c.sync(mb):
                torch.autograd.backward(tensors, grads)
        if mb == len(c.lowered) - 1:   # every count is known: correct the means' guesses
            settle_means(c.means)
        return {p: [vals[x.out].grad for x in low.into(self.s, p) if x.grad]
                for p in self.grad_to}

    def grad_send(self, p: int) -> Callable:
        def grad_send(mb: int, grads: dict) -> None:
            xs = [x for x in self.call().lowered[mb].into(self.s, p) if x.grad]
            with torch.no_grad():
                for x, g in zip(xs, grads[p]):
                    if g is None:  # the value did not reach the loss: its gradient is zero
                        g = torch.zeros(_received_shape(x, self.env), dtype=x.meta.dtype,
                                        device=self.env.comm.device(x.meta.placement.device_type))
                    self._sent(dual_step(x.step), g.contiguous())
        return grad_send

    def grad_recv(self, t: int) -> Callable:
        def grad_recv(mb: int) -> list:
            xs = [x for x in self.call().lowered[mb].out_of(self.s, t) if x.grad]
            return [self._received(x, dual_step(x.step)) for x in xs]
        return grad_recv


def _empty(x, env: Env) -> torch.Tensor:
    return empty_local(x.meta.dtype, env.comm.device(x.meta.placement.device_type))


def _received_shape(x, env: Env) -> tuple:
    """This rank's shard shape of transfer ``x``'s received value."""
    st = x.step
    pl = st.dst_placement
    return local_shape(st.shape, pl.shape, st.dst_sbp, pl.coord_of(env.comm.rank))


def _noop(mb: int, *values: Any) -> None:
    return None


def _in_stream(stream: str, fn: Callable, failures: Callable[[], int]) -> Callable:
    """``fn`` with its collectives in ``stream``: an actor's collectives pair with the same
    actor's on the other ranks of its stage, whatever order each rank's actors fire in (the
    forward of one micro-batch and the backward of another may swap between ranks). The stream
    is renamed after each failed run (``failures()``): an aborted collective leaves the ranks'
    call counts apart, and a new series starts them together again."""
    named = [-1, ""]  # the failure count the name was made for, the name (made once a series)

    def run(*args: Any) -> Any:
        n = failures()
        if n != named[0]:
            named[:] = [n, f"{stream}/{n}"]
        previous = set_collective_stream(named[1])
        try:
            return fn(*args)
        finally:
            set_collective_stream(previous)
    return run


def _stage_actors(st: _StageActors, stages: int, micro_batches: int, schedule: str,
                  trains: bool, update: bool, name: str, failures: Callable[[], int],
                  scale_from: tuple | None = None) -> list[ActorSpec]:
    """Stage ``st.s``'s actors; ``trains``: the graph runs a backward; ``scale_from``: as
    `_end_actors`'s."""
    s = st.s
    keep = trains or bool(st.targets)

    def wire(src: int, dst: int, fn: Callable, what: str = "value") -> Callable:
        # both ends of a transfer name one stream: a receive of a failed run is abandoned at
        # the runtime's interrupt instead of taking the next run's message
        return _in_stream(f"{name}/{what}{src}>{dst}", fn, failures)

    slots = activation_slots(schedule, s, stages, micro_batches) if trains else 2
    fwd_inputs = [Input(f"recv<{p}") for p in st.sources]
    if st.loads:  # one batch a call, read by every micro-batch's forward
        fwd_inputs.append(Input("load", repeat=micro_batches))
    fwd = st.forward if keep else (lambda mb, *r: st.forward(mb, *r) and None)
    specs = [ActorSpec("fwd", "forward", _in_stream(f"{name}/fwd", fwd, failures), stage=s,
                       inputs=fwd_inputs,
                       outputs={"saved": slots})]
    specs += [ActorSpec(f"recv<{p}", "recv", wire(p, s, st.recv(p)), stage=s,
                        queue=f"recv<{p}") for p in st.sources]
    if st.loads:
        # on the forward's thread: the batch was loaded ahead (the loader's thread or worker
        # processes), taking it is short, and a hand-off to the forward's thread would cost a
        # thread wake-up a call
        specs.append(ActorSpec("load", "load", st.load, stage=s, times=1, outputs=1,
                               queue="compute"))
    specs += [ActorSpec(f"send>{t}", "send", wire(s, t, st.send(t)), stage=s,
                        inputs=[Input("fwd", "saved")], queue=f"send>{t}")
              for t in st.targets]
    if not trains:
        return specs
    bwd_inputs = [Input("fwd", "saved")] + [Input(f"gradrecv<{t}") for t in st.grad_from]
    bwd = st.backward
    if schedule == "gpipe":
        specs.append(ActorSpec("flush", "compute", _noop, stage=s,
                               inputs=[Input("fwd", "saved")], emit_every=micro_batches,
                               outputs=1))
        bwd_inputs.append(Input("flush", repeat=micro_batches))
        bwd = (lambda mb, vals, *rest: st.backward(mb, vals, *rest[:-1]))
    specs.append(ActorSpec("bwd", "backward", _in_stream(f"{name}/bwd", bwd, failures), stage=s,
                           inputs=bwd_inputs))
    specs += [ActorSpec(f"gradrecv<{t}", "recv", wire(t, s, st.grad_recv(t), "grad"), stage=s,
                        queue=f"gradrecv<{t}") for t in st.grad_from]
    specs += [ActorSpec(f"gradsend>{p}", "send", wire(s, p, st.grad_send(p), "grad"), stage=s,
                        inputs=[Input("bwd")], queue=f"gradsend>{p}") for p in st.grad_to]
    return specs + _end_actors(st, micro_batches, update, scale_from, name, failures)


def _end_actors(st: _StageActors, micro_batches: int, update: bool, scale_from: tuple | None,
                name: str, failures: Callable[[], int]) -> list[ActorSpec]:
    """The actors after stage ``st.s``'s last backward: ``grads`` (the last backward done),
    the correction's (`scale_actors`) and ``update``. ``scale_from``: (the stage of a
    pipelined mean, its ranks); None: no correction to hand on."""
    s = st.s
    scale = scale_actors(st, scale_from)
    names = {a.name for a in scale}
    specs = [ActorSpec("grads", "compute", _noop, stage=s, inputs=[Input("bwd")],
                       emit_every=micro_batches, outputs=1)] if update or "scale" in names else []
    specs += scale
    if update:
        takes = [Input("grads")]
        if "scale<" in names:
            takes.append(Input("scale<"))
        update_fn = _in_stream(f"{name}/update",
                               lambda mb, _, *got: st.call().update(got[0] if got else None),
                               failures)
        specs.append(ActorSpec("update", "update", update_fn, stage=s, inputs=takes, times=1))
    return specs


def scale_actors(st: _StageActors, scale_from: tuple | None) -> list[ActorSpec]:
    """How a pipelined mean's correction (`graph_count_mean.upstream_scale`) reaches the other
    stages before their update (``scale_from``: the mean's stage and its ranks, the holders;
    None: no correction to hand on): on each holder, ``scale`` publishes its ``(scale,
    held)`` once the last backward is done; on every other rank ``scale<`` reads them all (a
    runtime req from each, one ack back: the holders never wait for the others' backwards,
    as an all-reduce would make them) and hands them to ``update``, or without an optimizer
    to the caller (a sink). On the compute thread: it fires between two kernels."""
    if scale_from is None:
        return []
    stage, holders = scale_from
    if st.s == stage:
        return [ActorSpec("scale", "compute", lambda mb, _: st.call().upstream(), stage=st.s,
                          inputs=[Input("grads")], times=1, outputs=1)]
    return [ActorSpec("scale<", "compute", lambda mb, *got: list(got), stage=st.s,
                      inputs=[Input("scale", rank=h) for h in holders], times=1, outputs=1)]


# the tasks that never talk to the communicator (an op with a kernel context may: ctx=)
_QUIET = (OpNode, DetachNode, ThunkNode, AssignNode)


def quiet_stages(lowered: Sequence[Lowered]) -> set:
    """The stages whose actors never wait for another rank in any of the ``lowered`` tapes: no
    backward (its gradient synchronisation), no transfer, no data source, and only kernels,
    detaches, random draws and in-place writes (no boxing, value check or other task)."""
    out = set()
    for s in lowered[0].forward:
        if all(not low.tape.backwards and not low.into(s) and not low.out_of(s)
               and not low.sources[s] and all(isinstance(n, _QUIET) and
                                              "ctx" not in getattr(n, "attrs", {})
                                              for n in low.forward[s]) for low in lowered):
            out.add(s)
    return out


def graph_plan(first: Lowered, stages: Sequence[frozenset], env: Env,
               call: Callable[[], GraphCall], micro_batches: int, schedule: str, update: bool,
               name: str, failures: Callable[[], int], scale_stage: int | None = None,
               quiet: set = frozenset()) -> Plan:
    """The plan of every rank (each runs its own; the others' tell it who its peers are).
    ``failures()``: the runtime's count of failed runs (the actors' collective streams);
    ``scale_stage``: the stage of a pipelined mean whose correction the others take
    (`scale_actors`), None for none; ``quiet``: the stages that never wait for another rank
    (`quiet_stages`: their ranks may run inline on any communicator, `Plan.solo`)."""
    trains = bool(first.tape.backwards)
    scale_from = None if scale_stage is None or not trains else \
        (scale_stage, tuple(sorted(stages[scale_stage])))
    actors = {}
    for s, ranks in enumerate(stages):
        st = _StageActors(s, env, call, first)
        for r in ranks:
            actors[r] = _stage_actors(st, len(stages), micro_batches, schedule, trains,
                                      update and trains, name, failures, scale_from)
    # the actors wait only in collectives and transfers (the runtime's interrupt or the
    # communicator's timeout ends them): a rank with nothing to overlap runs on its caller
    solo = frozenset(r for s in quiet for r in stages[s])
    return Plan(actors, name=name, inline=True, solo=solo)
