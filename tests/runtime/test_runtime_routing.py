"""The runtime on gloo processes over either message channel: direct sockets (a receiver
thread a process) or the store fallback (SBPFLOW_CHANNELS=store, no receiver thread); an
inbox reader thread a rank either way; the same values and counts (docs/runtime.md 'Message
channels')."""

import pytest
import torch

from runtime_gloo_fns import M, inputs
from runtime_route_fns import pipeline_threads_fn
from sbpflow.comm import launch


@pytest.mark.gloo
@pytest.mark.parametrize("channels", ["socket", "store"])
def test_gloo_pipeline_over_sockets_or_the_store_fallback(channels, monkeypatch):
    monkeypatch.setenv("SBPFLOW_CHANNELS", channels)  # the rank processes inherit it
    res = launch(pipeline_threads_fn, 3, backend="torch", args=("1f1b",))
    xs, ws = inputs()
    for mb in range(M):
        h = torch.tanh(torch.tanh(xs[mb] @ ws[0]) @ ws[1]) @ ws[2]
        g = h @ ws[2].T @ ws[1].T @ ws[0].T
        for run in (0, 1):
            torch.testing.assert_close(res[2]["outs"][run]["fwd2.out"][mb], h, rtol=0, atol=0)
            torch.testing.assert_close(res[0]["outs"][run]["bwd0"][mb], g, rtol=0, atol=0)
    for rank, r in enumerate(res):
        readers = [t for t in r["threads"] if t == f"sbpflow-rank{rank}-inbox"]
        receivers = [t for t in r["threads"] if t == f"sbpflow-rank{rank}-channels"]
        assert readers == [f"sbpflow-rank{rank}-inbox"]
        assert receivers == ([f"sbpflow-rank{rank}-channels"] if channels == "socket" else [])
        # rank 1 sends and receives an activation and a gradient of 4 float64 a micro-batch,
        # each run; ranks 0 and 2 one of them each way
        assert r["messages"] == r["received"] == (2 if rank == 1 else 1) * 2 * M * 4 * 8
