"""The update rules: which parameter version each (micro-batch, stage) uses, and the
arithmetic of the update that every executor and the closed-form reference share.

Version ``v`` of a stage is its parameters after ``v`` updates (``θ_0`` the initial ones;
``θ_{-1} := θ_0``). Cycle ``c`` of worker ``i`` on stage ``j`` uses (0-based ``i``, ``j``):
``dp`` ``θ_c``; ``v1`` ``θ_{c-1}``; ``v2`` ``θ_c`` when ``i + j >= N - 1`` (the spec's
``j >= N - i + 1``), else ``θ_{c-1}``. The update of cycle ``c`` sums the workers' gradients
in worker order and divides by N (`accumulate`, `average`), so the sums of every setting are
bit-for-bit those of the reference. Buffers (batch norm's running statistics) are part of a
version: each micro-batch's forward changes a copy of its version's buffers, and the update
adds the mean of those changes to the latest version's (`advance`). See docs/cdp.md, 'Rules
and versions'.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...errors import PlanError

__all__ = ["RULES", "timeline_of", "version", "version_read", "fresh", "version_table",
           "accumulate", "average", "advance", "check_rule"]

RULES = ("dp", "v1", "v2")


def check_rule(rule: str) -> None:
    if rule not in RULES:
        raise PlanError(f"unknown CDP rule {rule!r}; one of {RULES} (dp: synchronous "
                        f"reference, v1: one version behind (PipeDream-2BW), v2: the latest "
                        f"version published when F_j starts)")


def timeline_of(rule: str) -> str:
    """The timeline a rule runs on: DP's lock-step for ``dp``, the cyclic one for v1 / v2."""
    check_rule(rule)
    return "dp" if rule == "dp" else "cdp"


def fresh(rule: str, worker: int, stage: int, n: int) -> bool:
    """Whether (``worker``, ``stage``) uses the version of its own cycle (``θ_c``)."""
    check_rule(rule)
    if rule == "dp":
        return True
    return rule == "v2" and worker + stage >= n - 1


def version(rule: str, cycle: int, worker: int, stage: int, n: int) -> int:
    """The version (number of updates) cycle ``cycle`` of ``worker`` uses on ``stage``."""
    return version_read(fresh(rule, worker, stage, n), cycle)


def version_read(own: bool, cycle: int) -> int:
    """The version a task of cycle ``cycle`` reads: its own cycle's (``own``: `fresh`, θ_c)
    or the one before (θ_{c-1}; θ_0 in cycle 0)."""
    return cycle if own else max(cycle - 1, 0)


def version_table(rule: str, n: int) -> list[list[str]]:
    """The spec's table (b): ``"F"`` (fresh θ_c) or ``"S"`` (stale θ_{c-1}), a row a worker."""
    return [["F" if fresh(rule, i, j, n) else "S" for j in range(n)] for i in range(n)]


def accumulate(partial: Sequence[torch.Tensor] | None, grads: Sequence[torch.Tensor],
               into: bool = False) -> list[torch.Tensor]:
    """The running sum of a stage's gradients: ``partial + grads`` (``grads`` when first);
    ``into``: ``partial`` is a sum this function made, which nothing else reads: added to in
    place (the same values)."""
    if partial is None:
        return list(grads)
    if into:
        torch._foreach_add_(list(partial), list(grads))
        return list(partial)
    return [a + b for a, b in zip(partial, grads)]


def average(total: Sequence[torch.Tensor], n: int, into: bool = False) -> list[torch.Tensor]:
    """The averaged gradient the optimizer steps with: the worker-ordered sum over N;
    ``into``: ``total`` is a sum nothing else reads, divided in place (the same values)."""
    if into:  # (Tensor.div_, not a foreach division: on cuda that one divides where
        # ``t / n`` multiplies by 1 / n, and the last bit could differ)
        return [t.div_(n) for t in total]
    return [t / n for t in total]


def advance(buffers: Sequence[torch.Tensor], total: Sequence[torch.Tensor], n: int
            ) -> list[torch.Tensor]:
    """A stage's next buffers: the latest ``buffers`` plus the mean of the N micro-batches'
    changes (``total``, their worker-ordered sum; integer buffers, such as a count of
    batches, floor-divided: N changes of 1 add 1)."""
    return [b.detach() + (d / n if d.is_floating_point() else torch.div(d, n,
                                                                        rounding_mode="floor"))
            for b, d in zip(buffers, total)]
