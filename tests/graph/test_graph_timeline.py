"""The timeline of a graph call: a 4-stage GPT pipeline (1F1B, 8 uneven micro-batches, thread
ranks). Events are the 7-key dicts of every rank, on one clock (a stage's forward of a
micro-batch starts after the previous stage's ended, on another rank); each actor fires its
micro-batches in order, one at a time; 1F1B keeps S - s micro-batches in flight on stage s.
``save_timeline`` writes a PNG and ``save_trace`` a Chrome trace, from rank 0 only;
``print(graph)`` and ``graph.plan(rank)`` name the stages, ops, transfers and actors."""

import json
import re

import pytest

import sbpflow as sf
from graph_fns import gpt_pipeline
from sbpflow.runtime import KINDS, in_flight

S, M, N = 4, 8, 10
KEYS = {"rank", "actor", "kind", "stage", "micro_batch", "start", "end"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("timeline")
    results = sf.launch(gpt_pipeline, world_size=S,
                        args=([[r] for r in range(S)], ["blocks.1", "blocks.2", "blocks.3"],
                              None, sf.B, N, M, "1f1b", 2, str(out)))
    return results, out


def test_events_have_the_seven_keys_of_every_rank(run):
    results, _ = run
    events = results[0]["events"]
    for r in results[1:]:
        assert r["events"] == events  # every rank got every rank's events
    assert all(set(e) == KEYS for e in events)
    assert {e["rank"] for e in events} == set(range(S))
    kinds = {e["kind"] for e in events}
    assert kinds <= set(KINDS)
    assert {"forward", "backward", "send", "recv", "update"} <= kinds
    assert all(e["stage"] == e["rank"] for e in events)  # one single-rank stage a rank
    assert min(e["start"] for e in events) == 0.0
    assert all(0.0 <= e["start"] <= e["end"] for e in events)


def test_each_actor_fires_its_micro_batches_in_order_once_a_call(run):
    events = run[0][0]["events"]
    by_actor: dict = {}
    for e in sorted(events, key=lambda e: e["start"]):
        by_actor.setdefault((e["rank"], e["actor"]), []).append(e)
    for (rank, actor), evs in by_actor.items():
        assert [e["micro_batch"] for e in evs] == list(range(len(evs))), (rank, actor)
        assert all(a["end"] <= b["start"] for a, b in zip(evs, evs[1:])), (rank, actor)
    names = {r: {a for (rr, a) in by_actor if rr == r} for r in range(S)}
    assert names[0] >= {"fwd", "bwd", "send>1", "gradrecv<1", "update"}
    assert names[1] >= {"fwd", "bwd", "recv<0", "send>2", "gradrecv<2", "gradsend>0", "update"}
    assert names[3] >= {"fwd", "bwd", "recv<2", "gradsend>2", "update"}
    assert not any(a.startswith(("send", "gradrecv")) for a in names[3])
    for r in range(S):  # the last call only: M forwards and backwards, one update
        assert len(by_actor[r, "fwd"]) == len(by_actor[r, "bwd"]) == M
        assert len(by_actor[r, "update"]) == 1
        assert by_actor[r, "update"][0]["start"] >= by_actor[r, "bwd"][-1]["end"]


def test_one_clock_for_all_ranks(run):
    """A value leaves a stage after its forward ended and enters the next stage's forward
    (another rank's thread); gradients go the other way."""
    events = run[0][0]["events"]
    fwd = {(e["stage"], e["micro_batch"]): e for e in events if e["kind"] == "forward"}
    bwd = {(e["stage"], e["micro_batch"]): e for e in events if e["kind"] == "backward"}
    for s in range(1, S):
        for m in range(M):
            assert fwd[s, m]["start"] >= fwd[s - 1, m]["end"], (s, m)
            assert bwd[s - 1, m]["start"] >= bwd[s, m]["end"], (s, m)


def test_1f1b_bound(run):
    events = run[0][0]["events"]
    assert in_flight(events) == {s: S - s for s in range(S)}


def test_save_timeline_and_trace_written_by_rank_0(run):
    results, out = run
    assert sorted(p.name for p in out.iterdir()) == ["timeline0.png", "trace0.json"]
    assert (out / "timeline0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((out / "trace0.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # the trace is of the same call as the timeline the ranks returned (the last one)
    assert len(spans) == len(results[0]["events"])
    assert {e["pid"] for e in spans} == set(range(S))
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    assert {e["cat"] for e in spans} == {e["kind"] for e in results[0]["events"]}
    named = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert named == {f"rank {r}" for r in range(S)}


def test_plan_lists_the_actors_with_the_schedule_budget(run):
    results, _ = run
    for r, res in enumerate(results):
        plan = res["plan"]
        assert plan.startswith(f"plan 'graph1', rank {r}:")
        # 1F1B: stage s keeps S - s micro-batches' activations
        assert re.search(rf"^  fwd \(forward, stage {r}.*saved\[{S - r} slots\]", plan, re.M)
        for actor in ("bwd (backward", "grads (compute", "update (update"):
            assert f"  {actor}, stage {r}" in plan
        assert (f"  send>{r + 1} (send" in plan) == (r < S - 1)
        assert (f"  recv<{r - 1} (recv" in plan) == (r > 0)
        assert (f"  gradrecv<{r + 1} (recv" in plan) == (r < S - 1)
        assert (f"  gradsend>{r - 1} (send" in plan) == (r > 0)


def test_the_ranks_plans_agree_on_the_transfers(run):
    """A ``send>t`` on the ranks of stage s is a ``recv<s`` on those of stage t (the targets
    go from stage 0 straight to the last stage, which reads them), and the events too."""
    results, _ = run
    sends = {(r, int(a[5:])) for r, res in enumerate(results)
             for a in re.findall(r"^  (send>\d+) ", res["plan"], re.M)}
    recvs = {(int(a[5:]), r) for r, res in enumerate(results)
             for a in re.findall(r"^  (recv<\d+) ", res["plan"], re.M)}
    assert (0, 3) in sends
    assert sends == recvs
    fired = {(e["rank"], e["actor"]) for e in results[0]["events"]}
    assert (0, "send>3") in fired and (3, "recv<0") in fired


def test_print_names_stages_ops_parameters_and_transfers(run):
    text = run[0][0]["text"]
    assert text.startswith("TrainStep(GraphConfig(micro_batches=8, schedule='1f1b'")
    assert f"{S} stage(s), {M} micro-batch(es)" in text
    for s in range(S):
        assert f"stage {s} (ranks [{s}]):" in text
    for op in ("embedding(", "layer_norm(", "linear(", "attention(", "gelu("):
        assert op in text
    assert "model.tok.weight" in text and "model.blocks.3.mlp.fc.weight" in text
    # the first micro-batch has 2 rows: an activation of 2 x 8 x 16 float64 crosses each cut
    sends = re.findall(r"send %\d+ -> stage (\d) as %\d+  \[([\d,]+) B, gradient back\]", text)
    assert sorted(sends) == [("1", "2,048"), ("2", "2,048"), ("3", "2,048")]
    assert "backward(%" in text


def _timeline_on_rank_0_only() -> float:
    import time
    pl = sf.placement("cpu", [0, 1])
    lin = sf.nn.Linear(4, 2)
    sf.parallel.apply(lin, pl, {"*": sf.B})

    class Apply(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def build(self, x):
            return self.lin(x).sum()

    g = Apply()
    g(sf.ones(3, 4, placement=pl, sbp=sf.B))
    if sf.comm.rank() == 1:
        return 0.0
    start = time.monotonic()
    try:
        g.timeline()
    except sf.GraphError as exc:
        assert "every rank must call timeline()" in str(exc)
        return time.monotonic() - start
    raise AssertionError("timeline() on one rank returned")


def test_timeline_waits_at_most_the_launchs_timeout():
    """``sf.launch(..., timeout=3)`` bounds the exchange of events, as every wait of the run
    (it read SBPFLOW_TIMEOUT only: 300 s by default)."""
    waited = sf.launch(_timeline_on_rank_0_only, 2, timeout=3)[0]
    assert 3 <= waited < 10
