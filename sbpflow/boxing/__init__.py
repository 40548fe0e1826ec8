"""Boxing: plan and run the redistribution of a global tensor between two layouts.

``plan(shape, dtype, src=(placement, sbp), dst=(placement, sbp))`` shows the steps and their
bytes without running anything; ``run_plan`` applies a plan to this rank's local shard, each step
an autograd Function whose backward is the dual step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..comm import Communicator, current
from ..utils import renamed
from .executor import apply_step, empty_local, identity_value, run_step, whole_message
from .planner import BoxingPlan, plan, plan_layouts
from .steps import BoxingStep, dual_step

__all__ = ["BoxingPlan", "BoxingStep", "plan", "plan_layouts", "run_plan", "run_step",
           "apply_step",
           "dual_step", "empty_local", "identity_value", "record_steps", "whole_message"]


def run_plan(boxing_plan: BoxingPlan, local: torch.Tensor,
             comm: Communicator | None = None) -> torch.Tensor:
    """This rank's shard after running ``boxing_plan`` on its shard ``local`` (every rank of the
    world calls it; ranks outside both placements pass through)."""
    comm = comm or current()
    for step in boxing_plan.steps:
        local = apply_step(step, local, comm)
    return local


@contextlib.contextmanager
def record_steps() -> Iterator[list]:
    """Record the boxing steps this rank runs (forward and backward) while the block runs, as
    ``(phase, step)`` pairs in order, ``phase`` ``"forward"`` or ``"backward"`` (the dual step)::

        with sf.boxing.record_steps() as steps:
            loss = model(x); loss.backward()
        for phase, step in steps:
            print(phase, step.describe(), step.nbytes)
    """
    state = current().per_rank
    previous = state.boxing_trace
    steps: list = []
    state.boxing_trace = steps
    try:
        yield steps
    finally:
        state.boxing_trace = previous


__getattr__ = renamed(__name__, {"Step": "BoxingStep"})  # sf.boxing.Step, one release
