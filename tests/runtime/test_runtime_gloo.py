"""The actor runtime on the torch backend (gloo processes; messages over the c10d store):
values, repeated runs, failure and timeout (docs/runtime.md 'Message channels')."""

import pytest

from runtime_gloo_fns import M, assert_pipeline_values, failure_fn, pipeline_fn, timeout_fn
from sbpflow.comm import launch
from sbpflow.runtime import in_flight


@pytest.mark.gloo
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_on_gloo_processes(schedule):
    res = launch(pipeline_fn, 3, backend="torch", args=(schedule,))
    assert_pipeline_values(res)
    events = [e for r in res for e in r["events"]]
    want = {s: (M if schedule == "gpipe" else 3 - s) for s in range(3)}
    assert in_flight(events) == want
    # one clock for the processes of a machine: a stage's forward of a micro-batch starts
    # after the previous stage's (another process) ended
    fwd = {(e["stage"], e["micro_batch"]): e for e in events if e["kind"] == "forward"}
    assert all(fwd[s, mb]["start"] >= fwd[s - 1, mb]["end"] for s in (1, 2) for mb in range(M))
    assert res[1]["counters"] == {"fwd1": M, "bwd1": M}
    # rank 1 sends an activation and a gradient of 4 float64 a micro-batch, each run
    assert res[1]["messages"] == 2 * 2 * M * 4 * 8


@pytest.mark.gloo
def test_failure_on_gloo_processes():
    r0, r1 = launch(failure_fn, 2, backend="torch")
    assert r1["type"] == "KeyError"
    assert "raised by actor 'f' (forward, stage 0, micro-batch 2) on rank 1 (sbpflow " \
           "runtime)" in r1["notes"]
    assert r0["type"] == "ActorAborted"
    assert r0["message"] == ("actor 'f' (forward, stage 0, micro-batch 2) on rank 1 failed "
                             "with KeyError: 'bad micro-batch 2'; the runtime of rank 0 stopped")
    assert r0["end"] - r1["end"] < 10.0  # room for a loaded machine; the timeout is 300 s


@pytest.mark.gloo
def test_timeout_on_gloo_processes():
    r0, _ = launch(timeout_fn, 2, backend="torch")
    assert r0["type"] == "ActorTimeout"
    assert r0["message"].startswith("actor 'c' (forward, stage 0) on rank 0 waited ")
    assert "for input register p.out of rank 1 (no req for value 0 yet)" in r0["message"]
    assert 0.5 <= r0["seconds"] < 10.0  # the timeout is 0.5 s; room for a loaded machine
