"""Which of a trainer's runs measure what the rank holds: the saved-tensor hooks of
`sf.memory.track` (``peak_activation_bytes``) and the parameter-bytes samples
(``peak_param_bytes``; with peers, every run samples: `RankState.sample_always`).

A rank runs its forwards and backwards in the plan's order; when they all replay a stage's
fixed kernels (`stage_program`: traced on meta tensors, shapes following from the inputs'),
a run saves what an earlier run of the same plan, batch shapes and stage modes (train /
eval, hooks, grad mode, autocast) did, and on one rank holds the same parameters (with peers,
versions arrive at times that vary). So a run is measured until one of its key has been
measured from a measured start (the run before it measured too); later ones are not. A
forward that does not replay fixed kernels in a run that is not measured is measured on its
own, and every run is measured again until the same holds. Inside a caller's
`sf.memory.track` block every run is measured. See docs/cdp.md, 'Stats'.
"""

from __future__ import annotations

from typing import Sequence

from ... import memory

__all__ = ["WindowMeasure"]


def _shapes(tensors: Sequence) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


class WindowMeasure:
    """The measured (plan, batch shapes) of one trainer on one rank. ``always``: measure every
    run (the reference the tests compare with)."""

    def __init__(self, always: bool = False) -> None:
        self.always = always
        self.done: set = set()
        self.key: tuple | None = None
        self.before = False  # the last run was measured
        self.shapes: dict[int, tuple] = {}  # cycle -> its micro-batches' shapes and dtypes

    def fed(self, cycle: int, tensors: Sequence) -> None:
        """Cycle ``cycle``'s micro-batches (its xs, then its ys) were fed."""
        self.shapes[cycle] = _shapes(tensors)

    def retire(self, cycle: int) -> None:
        """Cycle ``cycle`` is done: no later run reads its micro-batches."""
        self.shapes.pop(cycle, None)

    def starts(self, plan: object, active: Sequence[tuple[int, int]], modes: tuple) -> bool:
        """Whether the run of ``plan`` over the cycles ``active`` (each `fed`) measures;
        ``modes``: the stages' `StageRunner.modes`."""
        shapes = self.shapes
        self.key = (id(plan), modes, tuple([shapes[c] for c, _ in active]))
        return self.always or self.key not in self.done or bool(memory.active_trackers())

    def ended(self, measured: bool, replayed_all: bool) -> None:
        """The run ended: it ``measured``, and every forward replayed fixed kernels
        (``replayed_all``)."""
        if not replayed_all:
            self.done.clear()  # a stage ran its module: its saved bytes may follow the data
        elif measured and self.before:
            self.done.add(self.key)
        self.before = measured
