"""sf.optim.Adam(W) updates a group in one fused call when its parameters share a step, dtype and
device, else one call per (step, dtype, device): both against torch.optim.AdamW on one device."""

import pytest
import torch

import sbpflow as sf
from nn_twin import F64, assert_close


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_parameters_at_different_steps_match_torch(amsgrad):
    """A parameter without a gradient in the first step is one step behind the others from then
    on: its bias corrections are its own (the group goes in two batches), as in torch."""
    gen = torch.Generator().manual_seed(0)
    w0, v0 = torch.randn(4, 6, dtype=F64, generator=gen), torch.randn(6, dtype=F64, generator=gen)
    xs = [torch.randn(5, 4, dtype=F64, generator=gen) for _ in range(4)]

    def loss(x, w, v, step):
        h = x @ w
        return (h * v).square().sum() if step else h.square().sum()   # step 0: v has no grad

    def body():
        pl = sf.placement("cpu", [0, 1])
        w = sf.tensor(w0, pl, sf.B).requires_grad_()
        v = sf.tensor(v0, pl, sf.B).requires_grad_()
        opt = sf.optim.AdamW([w, v], lr=0.1, amsgrad=amsgrad)
        for step, x in enumerate(xs):
            loss(sf.tensor(x, pl, sf.S(0)), w, v, step).backward()
            opt.step()
            opt.zero_grad()
        return w.full_tensor(), v.full_tensor(), [opt.state[p]["step"] for p in (w, v)]

    got_w, got_v, steps = sf.launch(body, world_size=2)[0]
    tw, tv = w0.clone().requires_grad_(), v0.clone().requires_grad_()
    opt = torch.optim.AdamW([tw, tv], lr=0.1, amsgrad=amsgrad, foreach=False)
    for step, x in enumerate(xs):
        loss(x, tw, tv, step).backward()
        opt.step()
        opt.zero_grad()
    assert steps == [4, 3]
    assert_close(got_w, tw.detach(), "w")
    assert_close(got_v, tv.detach(), "v")
