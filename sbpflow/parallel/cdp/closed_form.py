"""The closed-form CDP rule, with no schedule: the reference every setting is checked against.

For each step ``c`` and worker ``i`` in order, the whole model runs forward and backward (one
autograd graph) with stage ``j`` at the version the rule gives (`rules.version`); the
gradients are summed over the workers in order and each stage's optimizer steps on their mean
(`rules.accumulate`, `rules.average`, `StageOwner`). It runs on the calling rank alone, every
stage call eagerly (the trainer replays local stages: `stage_program`). See
docs/cdp.md, 'Rules and versions'.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ...comm import current
from ...placement import placement
from .cycles import check_n
from .rules import accumulate, check_rule, version
from .stage_runner import StageRunner
from .stage_split import stage_list
from .version_store import StageOwner

__all__ = ["closed_form"]


def closed_form(stages, loss_fn: Callable, optimizer: Callable, rule: str,
                batches: Iterable[tuple[torch.Tensor, torch.Tensor]], split=None,
                example_input=None
                ) -> tuple[dict[str, torch.Tensor], list[tuple[int, int, float]]]:
    """Train ``stages`` by ``rule`` on ``batches`` (``(x, y)`` global batches, each cut into
    N micro-batches along axis 0; ``split`` and ``example_input`` as `CyclicDataParallel`'s).
    Returns the final parameters keyed ``"{stage}.{name}"`` (as
    `CyclicDataParallel.state_dict`) and the losses ``(step, worker, value)``."""
    check_rule(rule)
    modules = stage_list(stages, split, example_input)
    runners = [StageRunner(m, j, programs=False) for j, m in enumerate(modules)]
    n = len(runners)
    check_n(n)
    pl = placement("cpu", [current().rank])
    versions = [{0: r.version(r.initial())} for r in runners]
    owners = [StageOwner(versions[j][0], pl, n, optimizer, runners[j].nparams)
              for j in range(n)]
    losses = []
    for c, (x, y) in enumerate(batches):
        xs = [p.clone() for p in torch.tensor_split(x.detach(), n)]
        ys = [p.clone() for p in torch.tensor_split(y.detach(), n)]
        totals: list = [None] * n
        for i in range(n):
            params = [versions[j][version(rule, c, i, j, n)] for j in range(n)]
            h, changes = xs[i], []
            for j in range(n - 1):
                h, ch = runners[j].forward(params[j], h, pl)
                changes.append(ch)
            loss, ch = runners[-1].forward(params[-1], h, pl, loss_fn, ys[i])
            changes.append(ch)
            flat = [t for r, p in zip(runners, params) for t in p[:r.nparams]]
            grads = StageRunner.backward(loss, None, flat)
            start = 0
            for j, r in enumerate(runners):
                k = r.nparams
                totals[j] = accumulate(totals[j], grads[start:start + k] + changes[j])
                start += k
            losses.append((c, i, float(loss.detach())))
        for j in range(n):
            versions[j][c + 1] = owners[j].step(versions[j][c], totals[j])
            versions[j].pop(c - 1, None)
    latest = {}
    for j, r in enumerate(runners):
        top = versions[j][max(versions[j])]
        latest.update({f"{j}.{name}": t.detach() for name, t in zip(r.names, top)})
    return latest, losses
