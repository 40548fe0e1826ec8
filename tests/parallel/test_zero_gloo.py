"""ZeRO on gloo processes: stages 1-3 of a float64 GPT on 2 processes (each stage's
collectives on its own process groups: the ZeRO worker's stream) train as the torch twin on one
device and send each stage's bytes (docs/zero.md)."""

import pytest
import torch

import sbpflow as sf
from gpt_twin import torch_gpt_train
from sbpflow.models import gpt_class

GPT = dict(vocab=30, d=16, heads=2, layers=2, seq=8)


def _batch(step: int) -> list:
    g = torch.Generator().manual_seed(50 + step)
    tok = torch.randint(0, GPT["vocab"], (8, GPT["seq"] + 1), generator=g)
    return [tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()]


def zero_fn() -> dict:
    """Each stage trains its copy 3 steps; the bytes of the last step by kind."""
    pl = sf.placement("cpu", list(range(sf.world_size())))
    out = {}
    for stage in (1, 2, 3):
        sf.manual_seed(0)
        m = gpt_class(sf.nn, sf.nn.functional)(**GPT).double()
        sd0 = m.state_dict()
        sf.parallel.apply(m, pl, {"*": sf.B}, zero=stage)
        opt = sf.optim.AdamW(m.parameters(), lr=0.02)
        losses = []
        for step in range(2):
            sf.parallel.zero.settle()
            sf.comm.reset_stats()
            tok, pos, tgt = _batch(step)
            loss = m(sf.tensor(tok, pl, sf.S(0)), sf.tensor(pos, pl, sf.B),
                     sf.tensor(tgt, pl, sf.S(0)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        sf.parallel.zero.settle()
        kinds = {k: v.sent for k, v in sf.comm.stats().kinds.items()}
        out[stage] = dict(sd0=sd0, losses=losses, sd=m.state_dict(), kinds=kinds)
    return out


@pytest.mark.gloo
def test_zero_stages_on_gloo_processes_train_as_torch():
    res = sf.launch(zero_fn, 2, backend="torch")
    params = sum(v.numel() for v in res[0][1]["sd0"].values()) * 8   # float64 bytes
    for stage in (1, 2, 3):
        r0 = res[0][stage]
        want, want_sd = torch_gpt_train(r0["sd0"], GPT, _batch, 2, lr=0.02)
        for r in res:
            torch.testing.assert_close(torch.tensor(r[stage]["losses"]), torch.tensor(want),
                                       rtol=1e-7, atol=1e-9)
            for k, v in want_sd.items():
                torch.testing.assert_close(r[stage]["sd"][k], v, rtol=1e-5, atol=1e-9)
        # summed over the ranks (shards may be uneven): an all-gather or a reduce-scatter of
        # every parameter sends |P|(N-1); stage 3 gathers in forward and again in backward
        kinds = [r[stage]["kinds"] for r in res]
        assert sum(k["reduce_scatter"] for k in kinds) == params
        assert sum(k["all_gather"] for k in kinds) == (2 if stage == 3 else 1) * params
