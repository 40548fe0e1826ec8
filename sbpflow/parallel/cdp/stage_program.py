"""A CDP stage's forward as its recorded local kernels, replayed without sbpflow's dispatch.

A stage runs on one rank's own placement, where every layout's shard is the whole tensor: its
ops are purely local, so once the kernels a call runs are known the call is those kernels on
plain torch tensors, in order (the same kernels on the same tensors as the eager call, so the
same values and the same autograd graph). `trace` runs the stage once on meta tensors with a
`StageTape` as the thread's recorder (the sbpflow.tensor hooks): it keeps each op's kernel,
constants and attributes, detaches and value checks, as a graph's records (`graph.nodes`).
Anything else the call does (a boxing step, a random draw, a tensor made outside the ops, a
constant, a custom autograd Function) makes the tape unusable and the stage stays eager. The
default seed stream is put back after the trace. `StageTape.replay` runs the kept kernels as
one generated function (`graph.replay.segment_program`). See docs/cdp.md, 'Stages'.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...comm import current
from ...graph.lower import frees_after
from ...graph.nodes import DetachNode, Env, GuardNode, Mode, OpNode, run_nodes
from ...graph.replay import programs_enabled, segment_program
from ...tensor import GlobalTensor, error_rule, set_recorder

__all__ = ["StageTape", "trace"]


class StageTape:
    """The recorder of one traced call: ``nodes`` over slots (the inputs' are ``0 ..
    len(inputs) - 1``), ``out`` the output's slot; ``usable`` False once the call did
    something a replay would not redo (``why`` says what)."""

    weighs_means = False  # read by means over counted targets: no micro-batch weighting here

    def __init__(self, inputs: Sequence[torch.Tensor], env: Env) -> None:
        self.slot_of = {id(t): k for k, t in enumerate(inputs)}
        self.keep = list(inputs)  # the traced tensors stay alive: their ids stay theirs
        self.nodes: list = []  # OpNode, DetachNode, GuardNode
        self.out: int | None = None
        self.nslots = 0
        self.env = env  # the rank's communicator and device type, as a graph's replay has
        self.program: Callable | None = None  # the nodes as one function (first replay)
        self.usable, self.why = True, ""
        self.checked = False  # a real call's eager output matched the replay's (`StageRunner`)

    def _slot(self, local: torch.Tensor) -> int | None:
        slot = self.slot_of.get(id(local))
        if slot is None:
            self._refuse("a tensor read that no recorded op made")
        return slot

    def _new(self, local: torch.Tensor) -> int:
        slot = self.slot_of[id(local)] = len(self.keep)
        self.keep.append(local)
        return slot

    def _refuse(self, why: str) -> None:
        if self.usable:
            self.usable, self.why = False, why

    # -- the hooks of sbpflow.tensor the tape keeps ----------------------------------------------
    def op(self, entry, args: tuple, boxed: list, local_args, attrs: dict, out, pl) -> None:
        if local_args is None or len(pl.flat_ranks) != 1:
            return self._refuse(f"op {entry.op.name} off the stage's own rank")
        slots = []
        for pos, a in enumerate(local_args):
            if isinstance(a, torch.Tensor):
                slots.append((pos, self._slot(a)))
        consts = [None if isinstance(a, torch.Tensor) else a for a in local_args]
        if any(isinstance(v, torch.Tensor) for v in attrs.values()):
            return self._refuse(f"op {entry.op.name} with a tensor among its attributes")
        if torch.is_autocast_enabled(pl.device_type):
            return self._refuse(f"op {entry.op.name} under autocast")
        outs = out if isinstance(out, tuple) else (out,)
        self.nodes.append(OpNode(entry.op.name, entry.op.kernel, tuple(consts), tuple(slots),
                                 dict(attrs), tuple(self._new(t._local) for t in outs),
                                 isinstance(out, tuple), entry.detach, pl, _mode(), (), (),
                                 error_rule()))

    def detach(self, src: GlobalTensor, out: GlobalTensor) -> None:
        s = self._slot(src._local)
        self.nodes.append(DetachNode(s, self._new(out._local), src.placement, _mode()))

    def guard(self, t: GlobalTensor, check: Callable) -> None:
        self.nodes.append(GuardNode(check, self._slot(t._local), t.placement, _mode()))

    def module(self, module) -> None:
        return None  # (train / eval modes are part of the trace's key)

    def __getattr__(self, name: str):  # every other hook: a call the replay would not redo
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(*_args, **_kwargs):
            self._refuse(f"the call's {name!r} (not a plain local kernel)")
        return refuse

    # -- replay ---------------------------------------------------------------------------------
    def replay(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The traced call's output on ``inputs`` (plain torch tensors, in the traced order):
        the nodes' kernels in their grad modes, each slot dropped after its last read."""
        if self.program is None:
            nodes, frees = self.nodes, frees_after(self.nodes, {self.out})
            self.program = segment_program(nodes, frees, "CDP stage") if programs_enabled() \
                else (lambda vals, env: run_nodes(nodes, vals, env, frees))
        vals = list(inputs) + [None] * (self.nslots - len(inputs))
        self.program(vals, self.env)
        return vals[self.out]


def _mode() -> Mode:
    """The grad mode an op was traced in (a tape under autocast is refused: `StageTape.op`)."""
    return Mode(torch.is_grad_enabled(), None)


def trace(run: Callable[[], GlobalTensor], inputs: Sequence[torch.Tensor], device_type: str
          ) -> StageTape:
    """The tape of ``run()`` (a stage's call on ``inputs``, meta tensors, already wrapped and
    put into its module by the caller, on ``device_type``), with this rank's default seed
    stream left as it was. The tape is unusable when the call raised or did anything but local
    kernels."""
    comm = current()
    tape = StageTape(inputs, Env(comm, device_type))
    state = comm.per_rank
    counter = getattr(state, "seed_counter", None)
    previous = set_recorder(tape)
    try:
        out = run()
        tape.out = tape.slot_of.get(id(out._local)) if isinstance(out, GlobalTensor) else None
        if tape.out is None:
            tape._refuse("an output no recorded op made")
    except Exception as exc:  # noqa: BLE001 - the stage runs eagerly, which raises it again
        tape._refuse(f"the traced call raised {type(exc).__name__}: {exc}")
    finally:
        set_recorder(previous)
        if counter is not None:
            state.seed_counter = counter
    tape.nslots, tape.keep, tape.slot_of = len(tape.keep), [], {}
    return tape
