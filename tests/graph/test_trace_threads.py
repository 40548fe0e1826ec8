"""The threads of a Chrome trace (`save_trace`): the kernels of a rank share its ``compute``
thread and every other actor (a transfer, a collective, a load) has a thread of its own, named
after it, so no two slices of one (pid, tid) overlap without nesting, which Perfetto would draw
mis-nested (a graph runs each transfer actor on a thread of its own: one thread a queue kind
had 10-17 such pairs in a 4-stage 1F1B trace)."""

import json

import torch

import sbpflow as sf
from sbpflow.runtime import save_trace

S, M = 4, 8


def _partial_overlaps(trace: list[dict]) -> list[tuple]:
    """Pairs of slices of one (pid, tid) that overlap without one containing the other (times
    within 1 ns count as equal: rounding, not overlap)."""
    by: dict[tuple, list] = {}
    for e in trace:
        if e["ph"] == "X":
            by.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e))
    bad, eps = [], 1e-3
    for key, spans in by.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        for i, (start, end, a) in enumerate(spans):
            for s2, e2, b in spans[i + 1:]:
                if s2 >= end - eps:
                    break
                if e2 > end + eps:
                    bad.append((key, a["name"], b["name"]))
    return bad


def _threads(trace: list[dict]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace
            if e["ph"] == "M" and e["name"] == "thread_name"}


def _ev(actor: str, kind: str, mb: int, start: float, end: float) -> dict:
    return {"rank": 0, "actor": actor, "kind": kind, "stage": 0, "micro_batch": mb,
            "start": start, "end": end}


def test_overlapping_actors_get_threads_of_their_own(tmp_path):
    """Two sends of one rank overlap (each on its own queue, as in a graph), and so does a
    compute actor on a queue of its own: each gets its own thread; the kernels that ran one
    after another share ``compute``."""
    events = [_ev("fwd", "forward", 0, 0.0, 1.0), _ev("send>1", "send", 0, 1.0, 3.0),
              _ev("send>3", "send", 0, 2.0, 4.0), _ev("bwd", "backward", 0, 5.0, 6.0),
              _ev("side", "compute", 0, 0.5, 1.5), _ev("fwd", "forward", 1, 3.0, 4.0)]
    save_trace(events, tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert _partial_overlaps(trace) == []
    names = _threads(trace)
    tid = {e["name"]: e["tid"] for e in trace if e["ph"] == "X"}
    assert tid["fwd #0"] == tid["fwd #1"] == tid["bwd #0"] == 0 and names[0, 0] == "compute"
    assert len({tid["fwd #0"], tid["side #0"], tid["send>1 #0"], tid["send>3 #0"]}) == 4
    assert names[0, tid["send>1 #0"]] == "send>1" and names[0, tid["side #0"]] == "side"


class _Step(sf.nn.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(M)
        self.config.set_pipeline_schedule("1f1b")

    def build(self, x):
        loss = self.model(x).pow(2).mean()
        loss.backward()
        return loss


def _pipelined_trace(path: str) -> list[dict]:
    """A 4-stage 1F1B graph (Linear + Tanh a stage) called twice; rank 0 writes the last
    call's trace to ``path``; returns the call's events."""
    stages = [sf.placement("cpu", [r]) for r in range(S)]
    sf.manual_seed(0)
    layers = []
    for _ in range(S):
        layers += [sf.nn.Linear(6, 6), sf.nn.Tanh()]
    model = sf.nn.Sequential(*layers).double()
    sf.parallel.pipeline(model, stages, split=[str(2 * i) for i in range(1, S)])
    step = _Step(model, sf.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2 * M, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        step(sf.tensor(x, stages[0], sf.B))
    step.save_trace(path)
    return step.timeline()


def test_a_pipelined_graphs_trace_has_no_partially_overlapping_slices(tmp_path):
    path = str(tmp_path / "trace.json")
    events = sf.launch(_pipelined_trace, world_size=S, args=(path,))[0]
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert len(spans) == len(events)
    assert _partial_overlaps(trace) == []
    names = _threads(trace)
    assert all((e["pid"], e["tid"]) in names for e in spans)  # every thread is named
    for e in spans:  # kernels on compute, every other actor on its own thread
        actor = e["name"].split(" #")[0]
        assert names[e["pid"], e["tid"]] == ("compute" if e["cat"] in
                                             ("forward", "backward", "update", "compute")
                                             else actor), e
    assert {n for (pid, _), n in names.items() if pid == 1} >= \
        {"compute", "recv<0", "send>2", "gradrecv<2", "gradsend>0"}
