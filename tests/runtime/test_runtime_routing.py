"""The runtime on gloo processes over either message channel: direct sockets (a receiver
thread a process, which hands the messages to the run itself: no inbox reader thread) or the
store fallback (SBPFLOW_CHANNELS=store, no receiver thread, an inbox reader thread a rank); the
same values and counts (docs/runtime.md 'Message channels')."""

import pytest

from runtime_gloo_fns import M, assert_pipeline_values
from runtime_route_fns import pipeline_threads_fn
from sbpflow.comm import launch


@pytest.mark.gloo
@pytest.mark.parametrize("channels", ["socket", "store"])
def test_gloo_pipeline_over_sockets_or_the_store_fallback(channels, monkeypatch):
    monkeypatch.setenv("SBPFLOW_CHANNELS", channels)  # the rank processes inherit it
    res = launch(pipeline_threads_fn, 3, backend="torch", args=("1f1b",))
    assert_pipeline_values(res)
    for rank, r in enumerate(res):
        readers = [t for t in r["threads"] if t == f"sbpflow-rank{rank}-inbox"]
        receivers = [t for t in r["threads"] if t == f"sbpflow-rank{rank}-channels"]
        assert readers == ([] if channels == "socket" else [f"sbpflow-rank{rank}-inbox"])
        assert receivers == ([f"sbpflow-rank{rank}-channels"] if channels == "socket" else [])
        # rank 1 sends and receives an activation and a gradient of 4 float64 a micro-batch,
        # each run; ranks 0 and 2 one of them each way
        assert r["messages"] == r["received"] == (2 if rank == 1 else 1) * 2 * M * 4 * 8
