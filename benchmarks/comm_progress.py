"""Cost of the torch backend's progress records (`sbpflow/comm/progress.py`) on the collective path.

Per-call time of a small all_reduce (8 floats) on 2 gloo processes, three ways, rounds
interleaved so that the machine's load hits all alike:
  records - the progress records as shipped (memory on the path, a thread publishes);
  stubbed - enter/leave are no-ops (the collective path as it was before the records);
  eager   - one store.set per collective (the arrival record written on the path).
Prints rank 0's medians and the median paired ratios against 'stubbed', and the cost of
enter + leave alone. Usage: python benchmarks/comm_progress.py [launches] [rounds]
(a launch: rounds x 3 modes x 500 all-reduces, about 2 s a round on a loaded 2-core machine).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.distributed import distributed_c10d as c10d

import sbpflow as sf
from sbpflow.comm import current


class _Off:
    def enter(self, key, kind):
        return 0

    def leave(self, key, seq):
        pass


class _Eager(_Off):
    def __init__(self, rank):
        self.rank, self.seq, self.store = rank, 0, c10d._get_default_store()

    def enter(self, key, kind):
        self.seq += 1
        self.store.set(f"arrive/{key}/{self.rank}", f"{self.seq} {kind}")
        return self.seq


def bench(rounds: int, n: int = 500) -> dict:
    comm = current()
    modes = {"records": comm.progress, "stubbed": _Off(), "eager": _Eager(comm.rank)}
    x, g = torch.ones(8), (0, 1)
    for _ in range(200):
        comm.all_reduce(x, g)
    times = {m: [] for m in modes}
    for _ in range(rounds):
        for m, p in modes.items():
            comm.progress = p
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                comm.all_reduce(x, g)
            times[m].append((time.perf_counter() - t0) / n * 1e6)
    comm.progress = modes["records"]
    return times


def hot_path(n: int = 200000) -> float:
    """enter + leave alone, in this process (an in-memory HashStore)."""
    import torch.distributed as dist
    from sbpflow.comm.progress import Progress
    p = Progress(0, dist.HashStore(), 1.0)
    t0 = time.perf_counter()
    for _ in range(n):
        p.leave("0_1", p.enter("0_1", "all_reduce(sum)"))
    dt = (time.perf_counter() - t0) / n * 1e6
    p.close()
    return dt


if __name__ == "__main__":
    print(f"enter+leave: {hot_path():.2f} us")
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    for _ in range(launches):
        t = sf.launch(bench, world_size=2, backend="torch", args=(rounds,))[0]
        med = {m: statistics.median(v) for m, v in t.items()}
        ratio = {m: statistics.median(a / b for a, b in zip(v, t["stubbed"])) for m, v in t.items()}
        print("  ".join(f"{m} {med[m]:.1f} us (x{ratio[m]:.3f})" for m in t))
