"""Functions that `test_runtime_gloo` launches on gloo ranks (each rank imports this module by
name: keep it cheap to import). Each builds the plan in the rank process, so its actors'
functions need not be picklable; failures are returned as data, so the test sees every
rank's outcome (launch would stop the others at the first exception)."""

from __future__ import annotations

import time

import torch

import sbpflow as sf
from sbpflow.comm import current
from sbpflow.runtime import ActorSpec, Input, Plan, Runtime, pipeline_plan

M = 5


def inputs() -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(M, 4, generator=g, dtype=torch.float64)
    ws = [torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    return xs, ws


def assert_pipeline_values(res: list) -> None:
    """The last stage's outputs and the first stage's input gradients of `pipeline_fn`'s two
    runs (``res``: one result a rank) equal the matmuls done here, exactly."""
    xs, ws = inputs()
    for mb in range(M):
        h = torch.tanh(torch.tanh(xs[mb] @ ws[0]) @ ws[1]) @ ws[2]
        g = h @ ws[2].T @ ws[1].T @ ws[0].T
        for run in (0, 1):
            torch.testing.assert_close(res[2]["outs"][run]["fwd2.out"][mb], h, rtol=0, atol=0)
            torch.testing.assert_close(res[0]["outs"][run]["bwd0"][mb], g, rtol=0, atol=0)


def pipeline_fn(schedule: str) -> dict:
    """A 3-stage pipeline of matmuls (the backward multiplies by the transposes), twice."""
    xs, ws = inputs()
    fwd = [lambda mb: xs[mb] @ ws[0], lambda mb, x: torch.tanh(x) @ ws[1],
           lambda mb, x: torch.tanh(x) @ ws[2]]
    bwd = [lambda mb, saved, g: g @ ws[0].T, lambda mb, saved, g: g @ ws[1].T,
           lambda mb, saved: saved @ ws[2].T]
    rt = Runtime(pipeline_plan(fwd, bwd, M, schedule))
    outs = [rt.run(M) for _ in range(2)]
    return {"outs": outs, "events": rt.timeline(), "counters": rt.counters(),
            "messages": current().stats()["message"].sent}


def _outcome(fn) -> dict:
    t = time.monotonic()
    try:
        return {"result": fn(), "seconds": time.monotonic() - t}
    except Exception as exc:  # noqa: BLE001 - returned for the test to read
        return {"type": type(exc).__name__, "message": str(exc),
                "notes": list(getattr(exc, "__notes__", [])), "end": time.time(),
                "seconds": time.monotonic() - t}


def failure_fn() -> dict:
    """Rank 1's actor fails at micro-batch 2; rank 0 waits for its values."""
    def fail(mb, x):
        if mb == 2:
            raise KeyError(f"bad micro-batch {mb}")
        return x

    plan = Plan({0: [ActorSpec("p", "load", lambda mb: torch.full((3,), float(mb))),
                     ActorSpec("c", "compute", lambda mb, x: x, inputs=[Input("f", rank=1)])],
                 1: [ActorSpec("f", "forward", fail, inputs=[Input("p", rank=0)])]})
    return _outcome(lambda: Runtime(plan).run(6))


def timeout_fn() -> dict:
    """Rank 1 never runs its part: rank 0's consumer times out naming the register."""
    plan = Plan({0: [ActorSpec("c", "forward", lambda mb, x: x, inputs=[Input("p", rank=1)])],
                 1: [ActorSpec("p", "forward", lambda mb: mb)]})
    if sf.comm.rank() == 1:
        return {}
    return _outcome(lambda: Runtime(plan, timeout=0.5).run(2))
