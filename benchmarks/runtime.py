"""The actor runtime's efficiency on a synthetic pipeline, and the cost of one actor firing.

Pipeline: S = 4 stages on 4 ranks, forward and backward kernels of fixed time t_f = t_b (a
sleep, which releases the GIL like a device kernel), M = 8 and 16 micro-batches, 1F1B and
GPipe (`sbpflow.runtime.pipeline_plan`). The ideal step is (M + S - 1)(t_f + t_b); the
efficiency is ideal / measured (median of the runs after a warm-up); 'kernel eff.' puts the
kernels' measured mean time in the ideal (a 5 ms sleep lasts ~5.1 ms), leaving the runtime's
own cost; the peak number of micro-batches in flight per stage is read from the timeline, and
so is the hand-over: the median µs from a stage's kernel end to the start of the kernel of the
next stage (forward) or previous one (backward) that waited for it, idle.
Firing cost: a chain of K actors with empty functions, M firings each, on one rank (all on one
queue thread, and each actor on its own), and a producer -> consumer pair across two ranks
(two output slots: the firings overlap the messages; one slot: each firing waits for the req
and the ack, a round trip, which is the hand-over latency a pipeline's critical path pays), and
the hand-over of that pair after the producer's fn slept 0, 1 or 5 ms (what a pipeline's
producer comes back from: on a virtual machine an idle core is slow to come back); a
run's fixed cost: run(1) of one empty actor a rank (what a graph call pays), 1 and 4 ranks.
``--busy N``: N processes busy-looping beside the benchmark for its whole run (a loaded machine).
Usage: python benchmarks/runtime.py [--backend threads|torch] [--runs N] [--ms T] [--busy N]
       [--timeline x.png] [--trace x.json]   (the last 1F1B M = 8 step's events)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time

import sbpflow as sf
from sbpflow.runtime import ActorSpec, Input, Plan, Runtime, in_flight, pipeline_plan
from sbpflow.runtime import save_timeline, save_trace


def _sleeper(t: float):
    def kernel(mb, *inputs):
        time.sleep(t)
        return mb
    return kernel


def pipeline_rank(stages: int, m: int, schedule: str, t: float, runs: int) -> tuple:
    """On each rank: the step times of ``runs`` runs (after one warm-up) and the last events."""
    plan = pipeline_plan([_sleeper(t)] * stages, [_sleeper(t)] * stages, m, schedule)
    rt = Runtime(plan)
    rt.run(m)
    steps = []
    for _ in range(runs):
        sf.comm.current().barrier()  # every rank starts the step together
        t0 = time.perf_counter()
        rt.run(m)
        steps.append(time.perf_counter() - t0)
    return steps, rt.timeline()


def firing_rank(k: int, m: int, one_queue: bool, cross: bool, slots: int = 2) -> float:
    """µs a firing: a chain of ``k`` empty actors (or, ``cross``, one producer on rank 0 with
    ``slots`` output slots and one consumer on rank 1), ``m`` firings each, best of 3 runs."""
    if cross:
        plan = _cross_plan(lambda mb: mb, slots, "cross")
        n = m
    else:
        specs = [ActorSpec("a0", "compute", lambda mb: mb, queue="q" if one_queue else "q0")]
        specs += [ActorSpec(f"a{i}", "compute", lambda mb, x: x, inputs=[f"a{i - 1}"],
                            queue="q" if one_queue else f"q{i}") for i in range(1, k)]
        plan = Plan({0: specs}, name="chain")
        n = k * m
    rt = Runtime(plan)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        rt.run(m)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def _cross_plan(produce, slots: int, name: str) -> Plan:
    """Producer ``p`` (fn ``produce``, ``slots`` output slots) on rank 0, an empty consumer
    ``c`` on rank 1."""
    return Plan({0: [ActorSpec("p", "load", produce, outputs=slots)],
                 1: [ActorSpec("c", "compute", lambda mb, x: x, inputs=[Input("p", rank=0)])]},
                name=name)


def sleep_hand_over_rank(sleep: float, m: int) -> list[dict]:
    """The events of a producer on rank 0 whose fn sleeps ``sleep`` s, one output slot, and an
    empty consumer on rank 1 (the second of two runs)."""
    rt = Runtime(_cross_plan(_sleeper(sleep), 1, "after-sleep"))
    rt.run(m)
    rt.run(m)
    return rt.timeline()


def after_sleep(backend: str, sleep: float, m: int) -> float:
    """Median µs from the producer's end to the consumer's start (`sleep_hand_over_rank`)."""
    res = sf.launch(sleep_hand_over_rank, 2, backend=backend, args=(sleep, m))
    ends = {e["micro_batch"]: e["end"] for e in res[0]}
    return statistics.median(e["start"] - ends[e["micro_batch"]] for e in res[1]) * 1e6


def run_cost_rank(runs: int = 500) -> tuple:
    """µs of ``run(1)`` of a plan of one empty actor a rank, no message between ranks: the
    median and the 90th percentile of ``runs`` runs after a warm-up."""
    world = sf.comm.current().world_size
    rt = Runtime(Plan({r: [ActorSpec("a", "compute", lambda mb: mb)] for r in range(world)},
                      name="one"))
    for _ in range(50):
        rt.run(1)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        rt.run(1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, statistics.quantiles(times, n=10)[-1] * 1e6


def hand_over(events: list[dict]) -> float:
    """Median µs from a kernel's end to the start of the kernel of another stage that waited
    for it idle (its stage's previous kernel had ended before): the cross-rank hand-over."""
    ends = {(e["kind"], e["stage"], e["micro_batch"]): e["end"] for e in events}
    gaps = []
    for rank in {e["rank"] for e in events}:
        mine = sorted((e for e in events if e["rank"] == rank and
                       e["kind"] in ("forward", "backward")), key=lambda e: e["start"])
        for prev, e in zip(mine, mine[1:]):
            step = -1 if e["kind"] == "forward" else 1
            dep = ends.get((e["kind"], e["stage"] + step, e["micro_batch"]))
            if dep is not None and prev["end"] <= dep:
                gaps.append(e["start"] - dep)
    return statistics.median(gaps) * 1e6 if gaps else float("nan")


@contextlib.contextmanager
def busy_loops(n: int):
    """``n`` processes spinning in a Python loop until the block ends (killed on any exit)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="threads", choices=["threads", "torch"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ms", type=float, default=5.0, help="t_f = t_b, milliseconds")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes beside it")
    ap.add_argument("--timeline", help="write the 1F1B M=8 step's Gantt chart here (PNG)")
    ap.add_argument("--trace", help="write the 1F1B M=8 step's Chrome trace here (JSON)")
    a = ap.parse_args()
    with busy_loops(a.busy):
        measure(a)


def measure(a: argparse.Namespace) -> None:
    """Print every table of the module docstring for the options ``a``."""
    stages, t = 4, a.ms / 1e3
    busy = f", {a.busy} busy-looping processes beside it" if a.busy else ""
    print(f"pipeline: S = {stages}, t_f = t_b = {a.ms:g} ms, {a.backend} backend, median of "
          f"{a.runs} steps{busy}")
    print(f"{'schedule':>8} {'M':>3} {'ideal ms':>9} {'step ms':>8} {'efficiency':>10} "
          f"{'kernel eff.':>11} {'hand-over µs':>12}  in flight")
    for m in (8, 16):
        for schedule in ("1f1b", "gpipe"):
            res = sf.launch(pipeline_rank, stages, backend=a.backend,
                            args=(stages, m, schedule, t, a.runs))
            step = statistics.median(max(r[0][i] for r in res) for i in range(a.runs))
            ideal = (m + stages - 1) * 2 * t
            events = [e for r in res for e in r[1]]
            peaks = [in_flight(events)[s] for s in range(stages)]
            kern = statistics.mean(e["end"] - e["start"] for e in events
                                   if e["kind"] in ("forward", "backward"))
            print(f"{schedule:>8} {m:>3} {ideal * 1e3:>9.1f} {step * 1e3:>8.1f} "
                  f"{ideal / step:>10.3f} {(m + stages - 1) * 2 * kern / step:>11.3f} "
                  f"{hand_over(events):>12.0f}  {peaks}")
            if schedule == "1f1b" and m == 8:
                if a.timeline:
                    save_timeline(events, a.timeline, title=f"1F1B, S = {stages}, M = {m}, "
                                  f"t_f = t_b = {a.ms:g} ms ({a.backend} backend)")
                if a.trace:
                    save_trace(events, a.trace)
    print("\ncost of one firing (µs; empty actor functions):")
    k, m = 4, 2000
    one = sf.launch(firing_rank, 1, backend=a.backend, args=(k, m, True, False))[0]
    own = sf.launch(firing_rank, 1, backend=a.backend, args=(k, m, False, False))[0]
    cross = sf.launch(firing_rank, 2, backend=a.backend, args=(k, m, True, True))
    trip = sf.launch(firing_rank, 2, backend=a.backend, args=(k, m // 2, True, True, 1))
    print(f"  chain of {k} actors on one queue thread:      {one:7.1f}")
    print(f"  chain of {k} actors, a queue thread each:     {own:7.1f}")
    print(f"  producer -> consumer across two ranks:      {cross[0]:7.1f}")
    print(f"  the same, one slot (a round trip a firing): {trip[0]:7.1f}")
    sleeps = (0.0, 0.001, 0.005)
    gaps = [after_sleep(a.backend, t, 200 if t < 0.004 else 60) for t in sleeps]
    print("  hand-over to the consumer after the producer's fn slept 0 / 1 / 5 ms (one slot): "
          + " / ".join(f"{g:.0f}" for g in gaps))
    print("\nfixed cost of a run (µs; run(1), one empty actor a rank; median / 90th percentile):")
    for n in (1, 4):
        costs = sf.launch(run_cost_rank, n, backend=a.backend)
        print(f"  {n} rank(s): " + ", ".join(f"{m:.0f} / {p:.0f}" for m, p in costs))


if __name__ == "__main__":
    main()
