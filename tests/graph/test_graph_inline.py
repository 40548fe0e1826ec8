"""A data-parallel graph runs each rank's actors on the calling thread (one stage, one queue:
no hand-off to a compute thread), with exactly the results of the same plan run on queue
threads: losses, weights and timeline (docs/runtime.md, 'Actors and registers')."""

import torch

import sbpflow as sf
from graph_fns import EXAMPLES, mlp_setup
from sbpflow.runtime import Plan


def _three_calls() -> dict:
    step, pl, sbp = mlp_setup(False)
    losses = []
    for i in range(3):
        x, y = EXAMPLES["mlp"].data(i, 8)
        losses.append(float(step(sf.tensor(x, pl, sbp), sf.tensor(y, pl, sbp)).to_local()))
    compiled = step._current()
    kinds = sorted(e["actor"] for e in step.timeline())
    return dict(losses=losses, sd={k: v.clone() for k, v in step.model.state_dict().items()},
                inline=compiled.runtime.inline,
                workers=sorted(compiled.runtime.workers._workers), actors=kinds)


def test_data_parallel_graph_runs_inline_as_on_threads(monkeypatch):
    inline = sf.launch(_three_calls, world_size=2)
    monkeypatch.setattr(Plan, "runs_inline", lambda self, rank: False)
    threaded = sf.launch(_three_calls, world_size=2)
    for r, (a, b) in enumerate(zip(inline, threaded)):
        assert a["inline"] and not b["inline"]
        # the runtime's queue threads: none inline
        assert a["workers"] == [] and b["workers"] == [f"sbpflow-rank{r}-compute"]
        assert a["losses"] == b["losses"]
        assert a["actors"] == b["actors"]
        for k, v in a["sd"].items():
            assert torch.equal(v, b["sd"][k]), k
