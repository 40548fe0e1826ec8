"""``print(graph)``: the logical graph of a compiled step, one task a line, stage by stage.

Each line names the value it makes (``%n``), the op or boxing, its inputs (``%k``, a parameter by
name, a constant), and the layout of the result; boxing lines give the collectives and the
bytes they move (summed over ranks); transfers give the stages they join.
"""

from __future__ import annotations

from ..sbp import format_nd_sbp
from .lower import Lowered
from .nodes import AssignNode, BackwardNode, BoxNode, DetachNode, GuardNode, OpNode, ThunkNode

__all__ = ["describe"]


def _names(graph) -> dict[int, str]:
    """id(tensor) -> its name among the parameters and buffers of the graph's modules."""
    out: dict[int, str] = {}
    for attr, value in vars(graph).items():
        for method in ("named_parameters", "named_buffers"):
            fn = getattr(value, method, None)
            if callable(fn):
                for name, t in fn():
                    out.setdefault(id(t), f"{attr}.{name}")
    return out


def _value(slot: int, names: dict[int, str]) -> str:
    return names.get(slot, f"%{slot}")


def _line(node, low: Lowered, names: dict[int, str]) -> str:
    metas = low.tape.metas
    if isinstance(node, OpNode):
        args = []
        slots = dict(node.slots)
        for pos, a in enumerate(node.args):
            args.append(_value(slots[pos], names) if pos in slots else repr(a))
        outs = ", ".join(f"%{o}" for o in node.outs)
        m = metas[node.outs[0]]
        return (f"{outs} = {node.name}({', '.join(args)})  -> {m.shape} "
                f"{format_nd_sbp(node.outs_sbp[0]) if node.outs_sbp else ''}")
    if isinstance(node, BoxNode):
        src = metas[node.src] if node.src in metas else None
        kinds = ", ".join(f"{st.kind} {st.nbytes:,} B" for st in node.steps)
        frm = format_nd_sbp(src.sbp) if src else "?"
        to = format_nd_sbp(node.steps[-1].dst_sbp) if node.steps else ""
        return f"%{node.out} = box({_value(node.src, names)}) {frm} -> {to}  [{kinds}]"
    if isinstance(node, DetachNode):
        return f"%{node.out} = detach(%{node.src})"
    if isinstance(node, ThunkNode):
        return f"%{node.out} = draw()  (a new random value each call)"
    if isinstance(node, GuardNode):
        return f"check(%{node.src})  (index range, on every call)"
    if isinstance(node, AssignNode):
        return f"{_value(node.dst, names)}.copy_({_value(node.src, names)})  (in place)"
    if isinstance(node, BackwardNode):
        return f"backward(%{node.loss})"
    return repr(node)


def describe(graph, low: Lowered, stages: list, micro_batches: int) -> str:
    """The text ``print(graph)`` shows."""
    tape = low.tape
    known = _names(graph)
    names = {slot: known.get(id(t), f"const%{slot}") for slot, t in tape.externals}
    lines = [f"{len(stages)} stage(s), {micro_batches} micro-batch(es); inputs "
             f"{', '.join(f'%{s}' for s in tape.inputs if s is not None)}"]
    for s, ranks in enumerate(stages):
        lines.append(f"stage {s} (ranks {sorted(ranks)}):")
        lines += [f"  {_line(n, low, names)}" for n in low.forward[s]]
        for x in low.out_of(s):
            lines.append(f"  send %{x.src} -> stage {x.dst_stage} as %{x.out}  "
                         f"[{x.step.nbytes:,} B{', gradient back' if x.grad else ''}]")
        lines += [f"  {_line(b, low, names)}" for b in low.backwards[s]]
    return "\n".join(lines)
