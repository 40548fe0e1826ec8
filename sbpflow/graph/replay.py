"""A stage's forward segment as one generated Python function: the replay with no per-op walk.

`segment_program(nodes, frees)` writes the tasks' local kernels as straight-line source, each
value a local variable, compiles it once, and returns ``run(vals, env)``, which does what
`nodes.run_nodes(nodes, vals, env, frees)` does (the same kernels, arguments, grad modes and
autocast, frees and slot values left in ``vals``), as one call run under torch autograd: an op
is ``v7 = K3(v5, v6, dim=A3_dim)``, a boxing step ``apply_step(S4_0, v7, comm)`` (its
collective called as a plain function), a detach ``v8 = v7.detach()``, a random draw sets the
seed stream's position and calls its thunk, a value check calls its check, an in-place write
``v2.copy_(v9)``. Tasks of other kinds, and ops with no kernel on this rank, run through their
own ``run(vals, env)`` with their slots written to ``vals`` before and read back after (the
fallback: a mean over counted targets, ZeRO's unit gathers and releases, `Recorder.task`'s).
``SBPFLOW_GRAPH_PROGRAM=0`` replays by the walk instead. See docs/runtime.md, 'Graph mode'.
"""

from __future__ import annotations

import keyword
import os
from typing import Callable

from ..boxing import apply_step
from ..utils import generated_function
from .lower import reads, writes
from .nodes import AssignNode, BoxNode, DetachNode, GuardNode, Mode, OpNode, ThunkNode

__all__ = ["segment_program", "programs_enabled"]


def programs_enabled() -> bool:
    """Whether stages replay as generated programs (``SBPFLOW_GRAPH_PROGRAM``, default on)."""
    return os.environ.get("SBPFLOW_GRAPH_PROGRAM", "1") != "0"


class _Writer:
    """The source lines and the names they use (``ns``: name -> object)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ns: dict = {"_apply_step": apply_step, "_Mode_now": Mode.now}

    def bind(self, name: str, value) -> str:
        self.ns[name] = value
        return name

    def emit(self, line: str, indent: int = 1) -> None:
        self.lines.append("    " * indent + line)


def _op_call(w: _Writer, i: int, node: OpNode) -> str:
    """``K3(v5, C3_1, dim=A3_dim)``: the kernel call of op node ``i``."""
    args = [w.bind(f"C{i}_{p}", a) for p, a in enumerate(node.args)]
    for pos, s in node.slots:
        args[pos] = f"v{s}"
    if all(k.isidentifier() and not keyword.iskeyword(k) for k in node.attrs):
        args += [f"{k}={w.bind(f'A{i}_{k}', v)}" for k, v in node.attrs.items()]
    else:
        args.append(f"**{w.bind(f'A{i}', node.attrs)}")
    return f"{w.bind(f'K{i}', node.kernel)}({', '.join(args)})"


def _emit_op(w: _Writer, i: int, node: OpNode) -> None:
    call = _op_call(w, i, node)
    tail = ".detach()" if node.detach else ""
    target = f"_r{i}" if node.multi else f"v{node.outs[0]}"
    if node.translate is None:
        w.emit(f"{target} = {call}")
    else:  # the rule the op was traced under turns torch's error into sbpflow's, as in eager
        w.emit("try:")
        w.emit(f"{target} = {call}", 2)
        w.emit("except Exception as _e:")
        w.emit(f"_n = {w.bind(f'T{i}', node.translate)}(_e)", 2)
        w.emit("if _n is None:", 2)
        w.emit("raise", 3)
        w.emit("raise _n from None", 2)
    if node.multi:
        for k, o in enumerate(node.outs):
            w.emit(f"v{o} = _r{i}[{k}]{tail}")
    elif tail:
        w.emit(f"{target} = {target}{tail}")


def _emit_task(w: _Writer, i: int, node) -> bool:
    """The source of task ``i``; False for a kind the program does not write (the fallback)."""
    if isinstance(node, OpNode) and node.kernel is not None:
        _emit_op(w, i, node)
    elif isinstance(node, BoxNode):
        x = f"v{node.src}"
        for k, step in enumerate(node.steps):
            x = f"_apply_step({w.bind(f'S{i}_{k}', step)}, {x}, _comm)"
        w.emit(f"v{node.out} = {x}")
    elif isinstance(node, DetachNode):
        w.emit(f"v{node.out} = v{node.src}.detach()")
    elif isinstance(node, ThunkNode):   # its place in the default seed stream, as in the walk
        w.emit(f"_pr.seed_counter = _env.draw_base + {node.index}")
        w.emit(f"v{node.out} = {w.bind(f'D{i}', node.make)}()")
    elif isinstance(node, GuardNode):
        w.emit(f"{w.bind(f'G{i}', node.check)}(v{node.src})")
    elif isinstance(node, AssignNode):
        if node.fresh:
            w.emit(f"v{node.dst} = v{node.dst}.clone()")
        w.emit(f"v{node.dst}.copy_(v{node.src})")
    else:
        return False
    return True


def _emit_fallback(w: _Writer, i: int, node, mirrored: set) -> None:
    """Task ``i`` by its own ``run(vals, env)``: its slots go through ``vals``."""
    touched = tuple(dict.fromkeys(reads(node) + writes(node)))
    for s in reads(node):
        w.emit(f"vals[{s}] = v{s}")
    w.emit(f"{w.bind(f'N{i}', node)}.run(vals, _env)")
    for s in touched:
        w.emit(f"v{s} = vals[{s}]")
    mirrored.update(touched)


def segment_program(nodes: list, frees: list, label: str = "segment") -> Callable:
    """``run(vals, env)``: ``nodes`` (a lowered stage's forward) with ``frees[i]`` dropped after
    task i, as `run_nodes` runs them (module docstring)."""
    w = _Writer()
    entry = []            # slots read before any task writes them: taken from ``vals``
    written: set = set()
    for node in nodes:
        entry += [s for s in reads(node) if s not in written and s not in entry]
        written.update(writes(node))
    mirrored = set(entry)   # slots whose value ``vals`` also holds
    for s in entry:
        w.emit(f"v{s} = vals[{s}]")
    w.emit("_comm = _env.comm")
    w.emit("_pr = _comm.per_rank")
    w.emit("_dev = _env.device_type")
    w.emit("_saved = _Mode_now(_dev)")
    w.emit("_m = _saved")
    w.emit("try:")
    body = len(w.lines)
    live: set = set(entry)
    mode = None
    for i, node in enumerate(nodes):
        if node.mode != mode:   # the first task's mode is checked against the thread's
            m = w.bind(f"M{i}", node.mode)
            if mode is None:
                w.emit(f"if _m != {m}:")
                w.emit(f"_m = {m}", 2)
                w.emit(f"{m}.enter(_dev)", 2)
            else:
                w.emit(f"_m = {m}")
                w.emit(f"{m}.enter(_dev)")
            mode = node.mode
        if not _emit_task(w, i, node):
            _emit_fallback(w, i, node, mirrored)
        live.update(writes(node))
        for s in frees[i]:
            w.emit(f"v{s} = None")
            if s in mirrored:
                w.emit(f"vals[{s}] = None")
            live.discard(s)
    for s in sorted(live):   # what the later actors and the caller read
        w.emit(f"vals[{s}] = v{s}")
    if len(w.lines) == body:
        w.emit("pass")
    w.lines[body:] = ["    " + line for line in w.lines[body:]]
    w.emit("finally:")
    w.emit("if _m != _saved:", 2)
    w.emit("_saved.enter(_dev)", 3)
    return _compile(w, label)


def _compile(w: _Writer, label: str) -> Callable:
    src = "def run(vals, _env):\n" + "\n".join(w.lines) + "\n"
    return generated_function(src, f"graph program: {label}", w.ns)
