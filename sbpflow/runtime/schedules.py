"""Pipeline schedules as register budgets, and the plan of a linear pipeline.

A stage's forward actor keeps what its backward needs in a register ("saved"); the slot is
taken when the forward fires and freed when the backward acks it, so the slot count bounds the
micro-batches in flight on the stage. GPipe gives every stage M slots (all forwards may run
first); 1F1B gives stage s of S only S - s, which forces one backward before each further
forward once the pipeline is full. Nothing else orders the work. See docs/runtime.md,
'Schedules as register budgets'.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..errors import PlanError
from .specs import ActorSpec, Input, Plan

__all__ = ["SCHEDULES", "activation_slots", "pipeline_plan"]

SCHEDULES = ("1f1b", "gpipe")


def activation_slots(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Slots of stage ``stage``'s saved-activation register: GPipe M, 1F1B S - s (never more
    than M, which would be slots no micro-batch uses)."""
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {schedule!r}; one of {SCHEDULES}")
    if not 0 <= stage < stages:
        raise PlanError(f"stage {stage} outside a pipeline of {stages} stages")
    if micro_batches < 1:
        raise PlanError(f"a pipeline needs micro_batches >= 1, got {micro_batches}")
    return micro_batches if schedule == "gpipe" else min(stages - stage, micro_batches)


def _pair(fn: Callable[..., Any]) -> Callable[..., tuple]:
    """A forward fn whose value goes both to the next stage and to the saved register."""
    def forward(micro_batch: int, *inputs: Any) -> tuple:
        y = fn(micro_batch, *inputs)
        return y, y
    return forward


def _without_flush(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The last stage's backward fn, called without the flush's (empty) value."""
    def backward(micro_batch: int, saved: Any, _flush: Any) -> Any:
        return fn(micro_batch, saved)
    return backward


def _flush(micro_batch: int, saved: Any) -> None:
    return None


def pipeline_plan(forward: Sequence[Callable[..., Any]], backward: Sequence[Callable[..., Any]],
                  micro_batches: int, schedule: str = "1f1b",
                  ranks: Sequence[int] | None = None, name: str = "pipeline") -> Plan:
    """The plan of an S-stage linear pipeline, stage s on rank ``ranks[s]`` (default s).

    Stage s has actors ``fwd{s}`` and ``bwd{s}``. ``forward[s](mb, x)`` gets the previous
    stage's value (stage 0: ``forward[0](mb)``); its value goes to the next stage (register
    "out", 2 slots; the last stage's values are returned by ``run`` as ``"fwd{S-1}.out"``) and
    is kept for the backward (register "saved", `activation_slots` slots).
    ``backward[s](mb, saved, grad)`` gets it and the next stage's value (the last stage:
    ``backward[S-1](mb, saved)``); stage 0's backward values are returned as ``"bwd0"``.
    GPipe adds the flush: actor ``flush`` of the last stage reads every forward and publishes
    once, after the M-th; the last backward reads that value for all its M firings
    (``repeat``), so no backward starts before every forward is done.
    """
    stages = len(forward)
    if stages < 1 or len(backward) != stages:
        raise PlanError(f"a pipeline needs one forward and one backward a stage: got "
                        f"{len(forward)} forward and {len(backward)} backward functions")
    ranks = list(range(stages)) if ranks is None else [int(r) for r in ranks]
    if len(ranks) != stages or len(set(ranks)) != stages:
        raise PlanError(f"a pipeline of {stages} stages needs {stages} distinct ranks, got "
                        f"{ranks}")
    actors: dict[int, list[ActorSpec]] = {}
    for s, r in enumerate(ranks):
        slots = activation_slots(schedule, s, stages, micro_batches)
        fin = [Input(f"fwd{s - 1}", "out", ranks[s - 1])] if s else []
        bin_ = [Input(f"fwd{s}", "saved")]
        if s + 1 < stages:
            bin_.append(Input(f"bwd{s + 1}", "out", ranks[s + 1]))
        actors[r] = [
            ActorSpec(f"fwd{s}", "forward", _pair(forward[s]), stage=s, inputs=fin,
                      outputs={"out": 2, "saved": slots}),
            ActorSpec(f"bwd{s}", "backward", backward[s], stage=s, inputs=bin_, outputs=2),
        ]
    if schedule == "gpipe":
        last, bwd = actors[ranks[-1]], actors[ranks[-1]][1]
        last.insert(1, ActorSpec("flush", "compute", _flush, stage=stages - 1,
                                 inputs=[Input(f"fwd{stages - 1}", "saved")],
                                 emit_every=micro_batches, outputs=1))
        bwd.inputs = (*bwd.inputs, Input("flush", repeat=micro_batches))
        bwd.fn = _without_flush(bwd.fn)
    return Plan(actors, name=name)
