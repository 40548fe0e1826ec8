"""Timing step functions side by side on gloo processes (the benchmarks' shared method).

`take_turns` runs each function twice to warm up (a graph's first call compiles), then times
them barrier to barrier, taking turns step by step (A B A B ...): load from outside, which
drifts over seconds on a shared 2-core machine, hits them alike instead of whichever ran in a
noisier minute.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch.distributed as dist


def take_turns(steps_to_time: Sequence[Callable[[], object]], steps: int) -> list[list[float]]:
    """Seconds of each of ``steps`` steps of each function (one list a function)."""
    for step in steps_to_time:
        step()
        step()
    times: list[list[float]] = [[] for _ in steps_to_time]
    for _ in range(steps):
        for k, step in enumerate(steps_to_time):
            dist.barrier()
            t = time.perf_counter()
            step()
            dist.barrier()
            times[k].append(time.perf_counter() - t)
    return times
