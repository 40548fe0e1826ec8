"""A pipelined graph on gloo processes trains as its torch twin while a stranger connects to a
rank's message socket again and again and sends a pickle that would plant a file, and garbage:
nothing runs, the connections are dropped, the losses are torch's (docs/runtime.md 'What the
transport trusts')."""

import pytest
import torch

import sbpflow as sf
from graph_fns import torch_gpt
from stranger_fns import attacked_pipeline

TOL = dict(rtol=1e-9, atol=1e-9)
STEPS = 3


@pytest.mark.gloo
def test_a_pipelined_graph_trains_as_torch_under_a_strangers_connections(tmp_path):
    planted = tmp_path / "planted"
    res = sf.launch(attacked_pipeline, world_size=2, backend="torch",
                    args=(str(planted), STEPS))
    assert not planted.exists() and not any(r["planted"] for r in res)
    assert res[0]["dropped"] == 0 and res[1]["dropped"] >= 3  # each a connection refused
    t_losses, t_sd = torch_gpt(res[0]["sd0"], 10, STEPS)
    assert res[1]["losses"] == res[0]["losses"]
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(t_losses), **TOL)
    for k, v in t_sd.items():
        torch.testing.assert_close(res[0]["sd"][k], v, **TOL, msg=lambda m: f"{k}: {m}")
