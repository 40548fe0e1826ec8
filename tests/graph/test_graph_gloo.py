"""Graph mode on the torch backend (gloo processes, messages over the c10d store): a 2-stage
GPT pipeline with 2 micro-batches trains as its one-device torch twin; an op failing on the
last stage's data stops the other process promptly with an abort naming rank and actor; a
process that blocks instead of calling the graph makes the other time out naming the waiting
actor, never hang; a process stuck inside a compute actor is named, with the actor and the
micro-batch, by the error `sf.launch` raises."""

import json
import re

import pytest
import torch

import sbpflow as sf
from graph_fns import blocked_rank, failing_call, gpt_pipeline, torch_gpt
from stuck_fns import stuck_step

TOL = dict(rtol=1e-9, atol=1e-9)
PROMPT = 10.0  # room for a loaded machine (the default timeout is 300 s)
TIMEOUT = 2.0  # bounds every wait of the run: room for the processes' setup to drift apart
# a stuck rank's tests: its nap lasts until the run is stopped, so a longer timeout costs
# little and keeps the first steps' collectives (process start-up on a loaded machine) clear
STUCK_TIMEOUT = 5.0


@pytest.mark.gloo
def test_pipeline_on_gloo_processes_equals_torch():
    res = sf.launch(gpt_pipeline, world_size=2, backend="torch",
                    args=([[0], [1]], ["blocks.2"], None, sf.B, 10, 2, "1f1b"))
    t_losses, t_sd = torch_gpt(res[0]["sd0"], 10)
    assert res[1]["losses"] == res[0]["losses"]
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(t_losses), **TOL)
    for k, v in t_sd.items():
        torch.testing.assert_close(res[0]["sd"][k], v, **TOL, msg=lambda m: f"{k}: {m}")
    events = res[0]["events"]
    assert {e["rank"] for e in events} == {0, 1}
    fwd = {(e["stage"], e["micro_batch"]): e for e in events if e["kind"] == "forward"}
    assert all(fwd[1, m]["start"] >= fwd[0, m]["end"] for m in range(2))  # one clock


@pytest.mark.gloo
def test_a_failing_op_on_gloo_processes():
    r0, r1 = sf.launch(failing_call, world_size=2, backend="torch", args=(True,))
    where = "actor 'fwd' (forward, stage 1, micro-batch 1) on rank 1"
    assert "IndexError" in r1["types"] and "Target 7 is out of bounds" in r1["message"]
    assert f"raised by {where} (sbpflow runtime)" in r1["notes"]
    assert r0["type"] == "ActorAborted"
    assert r0["message"] == (f"{where} failed with {r1['type']}: {r1['message']}; the runtime "
                             f"of rank 0 stopped")
    assert r0["end"] - r1["end"] < PROMPT and r0["seconds"] < PROMPT


@pytest.mark.gloo
def test_a_blocked_process_times_out_the_previous_stage(monkeypatch, tmp_path):
    """Rank 0's call times out in an actor waiting for rank 1: the runtime's `ActorTimeout`
    naming it, or the receive's (or the send's, whose pair the receive's timeout closed)
    `CommTimeout` naming the peer; either says, from rank 1's progress record, that rank 1 is
    out of the runtime and waits for no one (gloo then closes the pair, so the launcher's
    closing barrier may fail, on rank 1 as a broken pair or on rank 0 as a timeout naming
    rank 1, which the launcher prefers: rank 0's outcome is read from its file)."""
    monkeypatch.setenv("SBPFLOW_TIMEOUT", str(TIMEOUT))  # the rank processes inherit it
    try:
        sf.launch(blocked_rank, world_size=2, backend="torch", args=(True, str(tmp_path)))
    except sf.errors.CommTimeout as exc:   # (rank 1 arrived at a barrier whose pair gloo closed)
        assert re.search(r"barrier over ranks \[0, 1\] .* timed out on rank 0 after .*"
                         r"(rank\(s\) \[1\] did not arrive|every member had entered)",
                         str(exc)), exc
    except sf.CommError as exc:
        assert "barrier over ranks [0, 1] failed" in str(exc), exc
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert TIMEOUT <= r0["seconds"] < PROMPT
    assert re.search(r"rank 1: .*out of the actor runtime for [\d.]+ s \(its last: run 1 of "
                     r"plan '[^']+'\).*; rank\(s\) \[1\] wait\(s\) for no other rank",
                     r0["message"]), r0
    if r0["type"] == "ActorTimeout":
        # (or, on a loaded machine, the gradient receiver inside its receive: the runtime's
        # watch may see it before the receive's own timeout)
        assert r0["message"].startswith(("actor 'fwd' (forward, stage 0) on rank 0 waited ",
                                         "actor 'send>1' (send, stage 0) on rank 0 waited ",
                                         "actor 'gradrecv<1' (recv, stage 0) on rank 0 has "
                                         "been inside its function for ")), r0
        assert f"(timeout {TIMEOUT:g} s, SBPFLOW_TIMEOUT)" in r0["message"]
    else:
        assert r0["type"] == "CommTimeout", r0
        assert "rank 1" in r0["message"] and "SBPFLOW_TIMEOUT" in r0["message"], r0
        assert r0["notes"][0].startswith(("raised by actor 'gradrecv<1' (recv, stage 0, ",
                                          "raised by actor 'send>1' (send, stage 0, ")), r0


def _stuck_error(mode: str, world: int, stuck: int) -> sf.CommError:
    """The error `sf.launch` raises when rank ``stuck`` naps inside its compute actor in the
    second step of `stuck_step` (``mode``) on ``world`` gloo processes."""
    with pytest.raises(sf.CommError) as info:
        sf.launch(stuck_step, world, backend="torch", args=(mode, stuck), timeout=STUCK_TIMEOUT)
    return info.value


@pytest.mark.gloo
def test_a_rank_stuck_in_a_data_parallel_graph_step_is_named():
    """Rank 1 of 2 sleeps inside its forward actor (micro-batch 0 of the second call); rank 0
    times out waiting (an actor, a collective or a process group's rendezvous of its stream):
    whichever error the launcher raises names rank 1, the actor, its micro-batch, and that it
    is in its own code (before, an `ActorTimeout` of rank 0 waiting for its own 'bwd')."""
    exc = _stuck_error("graph", 2, 1)
    assert exc.culprits == (1,), exc
    assert re.search(r"rank 1( \(this rank\))?: .*in run 2 of plan '[^']+' for [\d.]+ s: its "
                     r"thread 'sbpflow-rank1-compute' is inside actor 'fwd' \(forward, stage 0\), "
                     r"micro-batch 0, for [\d.]+ s, outside communication", str(exc)), exc


@pytest.mark.gloo
def test_a_rank_stuck_in_a_pipeline_stage_is_named():
    """3 stages, one a process; the last (rank 2) sleeps inside its forward actor. Rank 0
    waits for rank 1's gradient, rank 1 for rank 2's: the waits are followed through the
    progress records to rank 2, whatever rank's error the launcher raises (before: an
    `ActorTimeout` of rank 0 or 3, a 'Connection closed by peer', never rank 2)."""
    exc = _stuck_error("pipeline", 3, 2)
    assert exc.culprits == (2,), exc
    assert re.search(r"rank 2( \(this rank\))?: .*its thread 'sbpflow-rank2-compute' is inside "
                     r"actor 'fwd' \(forward, stage 2\), micro-batch 0, for [\d.]+ s, outside "
                     r"communication .*rank\(s\) \[2\] wait\(s\) for no other rank", str(exc)), exc
