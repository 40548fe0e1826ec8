"""Functions that `test_runtime_routing` launches on gloo ranks (imported by name in each rank
process: keep it cheap to import)."""

from __future__ import annotations

import threading

from runtime_gloo_fns import pipeline_fn
from sbpflow.comm import current


def pipeline_threads_fn(schedule: str) -> dict:
    """`pipeline_fn`, plus the names of the rank's live threads afterwards and the message
    bytes it received."""
    out = pipeline_fn(schedule)
    out["received"] = current().stats()["message"].recv
    out["threads"] = sorted(t.name for t in threading.enumerate())
    return out


def who_reads_fn(firings: int) -> dict:
    """A producer on rank 0 and a consumer on rank 1 with one slot (each firing waits for the
    other rank's message): the values rank 1 got, and the threads that read each rank's
    runtime messages off the sockets."""
    from sbpflow.runtime import ActorSpec, Input, Plan, Runtime

    comm = current()
    receiver = comm._chan()._receiver
    readers: list[str] = []
    put = receiver.put

    def counted(channel, item):
        if channel.startswith("sbpflow.runtime/"):
            readers.append(threading.current_thread().name)
        put(channel, item)
    receiver.put = counted
    plan = Plan({0: [ActorSpec("p", "load", lambda mb: mb * 10, outputs=1)],
                 1: [ActorSpec("c", "compute", lambda mb, x: x + 1,
                               inputs=[Input("p", rank=0)])]}, name="who-reads")
    rt = Runtime(plan)
    got = [rt.run(firings) for _ in range(2)]
    receiver.put = put
    return {"values": [g.get("c") for g in got], "readers": readers}
