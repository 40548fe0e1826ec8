"""sf.optim against torch.optim: the MLP trained in every layout gives torch's losses, gradient
norms and weights; gradients are reduced once per step; schedulers, state dicts, gradient
accumulation, activation checkpointing and bf16 autocast."""

import pytest
import torch

import sbpflow as sf
from nn_twin import (F64, LAYOUTS, OPTIMIZERS, assert_close, batch, layout, sf_loss, sf_mlp,
                     sf_train, torch_mlp, torch_train)


def _train_both(layout_name: str, opt_name: str, steps: int = 5):
    make_sf, make_torch = OPTIMIZERS[opt_name]

    def body():
        sf.manual_seed(0)
        m = sf_mlp()
        sd0 = m.state_dict()
        pl, x_sbp, rules = layout(layout_name)
        sf.parallel.apply(m, pl, rules)
        opt = make_sf(m.parameters())
        losses, norms = sf_train(m, opt, pl, x_sbp, steps)
        state_layouts = [(p.sbp, k, v.sbp, tuple(v.local.shape) == tuple(p.local.shape))
                         for p in m.parameters() for k, v in opt.state[p].items()
                         if isinstance(v, sf.GlobalTensor)]
        return sd0, losses, norms, m.state_dict(), state_layouts

    sd0, losses, norms, sd, state_layouts = sf.launch(body, world_size=4)[0]
    tm = torch_mlp()
    tm.load_state_dict(sd0)
    t_losses, t_norms = torch_train(tm, make_torch(tm.parameters()), steps)
    return (losses, norms, sd, state_layouts), (t_losses, t_norms, tm.state_dict())


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_training_matches_torch(layout_name, opt_name):
    (losses, norms, sd, state_layouts), (t_losses, t_norms, t_sd) = _train_both(layout_name,
                                                                                opt_name)
    assert_close(losses, t_losses, "losses")
    assert_close(norms, t_norms, "grad norms")
    assert min(norms) > 0.5  # clipping was active
    for k, v in t_sd.items():
        assert_close(sd[k], v, k)
    # optimizer state lives in the parameter's layout, shard by shard
    assert state_layouts and all(psbp == ssbp and same for psbp, _, ssbp, same in state_layouts)


def test_sgd_on_partial_sum_parameters():
    """SGD's update is linear, so even P-laid-out parameters train correctly."""
    make_sf, make_torch = OPTIMIZERS["sgd"]

    def body():
        sf.manual_seed(0)
        m = sf_mlp()
        sd0 = m.state_dict()
        pl = sf.placement("cpu", [0, 1, 2])
        sf.parallel.apply(m, pl, {"*": sf.P})
        losses, norms = sf_train(m, make_sf(m.parameters()), pl, sf.B, 4)
        adam = sf.optim.Adam(m.parameters())
        sf_loss(m, pl, sf.B, *batch(0)).backward()
        with pytest.raises(sf.SbpError, match="partial"):
            adam.step()
        return sd0, losses, norms, m.state_dict()

    sd0, losses, norms, sd = sf.launch(body, world_size=3)[0]
    tm = torch_mlp()
    tm.load_state_dict(sd0)
    t_losses, t_norms = torch_train(tm, make_torch(tm.parameters()), 4)
    assert_close(losses, t_losses, "losses")
    assert_close(norms, t_norms, "norms")
    for k, v in tm.state_dict().items():
        assert_close(sd[k], v, k)


@pytest.mark.parametrize("layout_name,grad_reductions", [("dp", 1), ("zero", 0), ("tp", 1)])
def test_gradients_are_reduced_once_per_step(layout_name, grad_reductions):
    """The optimizer boxes P grads of B params (all-reduce, the 4 of dp coalesced into one
    bucket) and nothing else; clipping adds one scalar all-reduce and reuses the boxed
    gradients."""
    def body(clip):
        sf.manual_seed(0)
        m = sf_mlp()
        pl, x_sbp, rules = layout(layout_name)
        sf.parallel.apply(m, pl, rules)
        opt = sf.optim.SGD(m.parameters(), lr=0.1)
        sf_loss(m, pl, x_sbp, *batch(0)).backward()
        sf.comm.reset_stats()
        if clip:
            sf.optim.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()
        st = sf.comm.stats()
        return {k: (v.calls, v.sent) for k, v in st.kinds.items()}

    plain = sf.launch(body, world_size=4, args=(False,))[0]
    clipped = sf.launch(body, world_size=4, args=(True,))[0]
    assert set(plain) <= {"all_reduce"} and plain.get("all_reduce", (0, 0))[0] == grad_reductions
    calls, sent = clipped["all_reduce"]
    assert set(clipped) == {"all_reduce"} and calls == grad_reductions + 1
    extra = sent - plain.get("all_reduce", (0, 0))[1]
    assert 0 < extra <= 3 * 8  # one float64 scalar more, not the gradients again


def test_adam_fused_default_updates_strided_shards_as_torch():
    """torch's fused kernel walks flat memory: a shard that is a strided view (a leaf made from
    a transposed tensor) is updated multi-tensor instead, the contiguous ones still fused."""
    w0 = torch.randn(4, 6, dtype=F64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 6, dtype=F64, generator=torch.Generator().manual_seed(1))

    def body():
        pl = sf.placement("cpu", [0, 1])
        strided = sf.tensor(w0.t(), pl, sf.B).requires_grad_()    # (6, 4), a transposed view
        plain = sf.tensor(w0.t().contiguous(), pl, sf.S(1)).requires_grad_()
        assert not strided.local.is_contiguous() and plain.local.is_contiguous()
        opt = sf.optim.AdamW([strided, plain], lr=0.1)
        for _ in range(3):
            xs = sf.tensor(x, pl, sf.B)
            ((xs @ strided).square().sum() + (xs @ plain).sum()).backward()
            opt.step()
            opt.zero_grad()
        result = strided.full_tensor(), plain.full_tensor()
        strided.grad = sf.zeros(6, 4, placement=pl, sbp=sf.P, dtype=F64)
        with pytest.raises(ValueError, match="fused=True"):
            sf.optim.AdamW([strided], lr=0.1, fused=True).step()
        return result

    got_strided, got_plain = sf.launch(body, world_size=2)[0]
    ws, wp = w0.t().clone().requires_grad_(), w0.t().clone().requires_grad_()
    opt = torch.optim.AdamW([ws, wp], lr=0.1, foreach=False)
    for _ in range(3):
        ((x @ ws).square().sum() + (x @ wp).sum()).backward()
        opt.step()
        opt.zero_grad()
    assert_close(got_strided, ws.detach(), "strided")
    assert_close(got_plain, wp.detach(), "plain")


@pytest.mark.parametrize("sched", ["step", "lambda", "cosine"])
def test_torch_lr_schedulers_drive_sf_optimizers(sched):
    makers = {"step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
              "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
              "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4)}

    def run_sf():
        sf.manual_seed(0)
        m = sf_mlp()
        sd0 = m.state_dict()
        pl, x_sbp, rules = layout("dp")
        sf.parallel.apply(m, pl, rules)
        opt = sf.optim.SGD(m.parameters(), lr=0.2, momentum=0.5)
        sch = makers[sched](opt)
        lrs, losses = [], []
        for step in range(5):
            lrs.append(opt.param_groups[0]["lr"])
            losses += sf_train(m, opt, pl, x_sbp, 1, first_step=step, clip=False)[0]
            sch.step()
        return sd0, lrs, losses, sch.state_dict()["last_epoch"]

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        sd0, lrs, losses, last_epoch = sf.launch(run_sf, world_size=4)[0]
    tm = torch_mlp()
    tm.load_state_dict(sd0)
    opt = torch.optim.SGD(tm.parameters(), lr=0.2, momentum=0.5)
    sch = makers[sched](opt)
    t_lrs, t_losses = [], []
    for step in range(5):
        t_lrs.append(opt.param_groups[0]["lr"])
        t_losses += torch_train(tm, opt, 1, first_step=step, clip=False)[0]
        sch.step()
    assert lrs == t_lrs and len(set(lrs)) > 1 and last_epoch == 5
    assert_close(losses, t_losses, "losses")


def test_optimizer_state_dict_is_torch_compatible():
    """sf state dicts load into torch optimizers and back; resuming gives torch's trajectory."""
    def body(torch_state):
        sf.manual_seed(0)
        m = sf_mlp()
        sd0 = m.state_dict()
        pl, x_sbp, rules = layout("zero")
        sf.parallel.apply(m, pl, rules)
        opt = sf.optim.AdamW(m.parameters(), lr=0.02, amsgrad=True)
        sf_train(m, opt, pl, x_sbp, 2)
        exported, weights = opt.state_dict(), m.state_dict()
        # a fresh optimizer (other lr, no state) resumes from the torch run's state
        opt2 = sf.optim.AdamW(m.parameters(), lr=0.5, amsgrad=True)
        opt2.load_state_dict(torch_state)
        p0 = next(iter(m.parameters()))
        layout_ok = all(v.sbp == p0.sbp for v in opt2.state[p0].values()
                        if isinstance(v, sf.GlobalTensor))
        sf_train(m, opt2, pl, x_sbp, 1, first_step=2)
        return sd0, exported, weights, m.state_dict(), opt2.state[p0]["step"], layout_ok

    # the torch run to compare against, from the same initial weights
    sd0 = sf.launch(lambda: (sf.manual_seed(0), sf_mlp().state_dict())[1], world_size=1)[0]
    tm = torch_mlp()
    tm.load_state_dict(sd0)
    topt = torch.optim.AdamW(tm.parameters(), lr=0.02, amsgrad=True, foreach=False)
    torch_train(tm, topt, 2)
    t_state = topt.state_dict()
    _, exported, weights, resumed, step, layout_ok = sf.launch(body, world_size=4,
                                                               args=(t_state,))[0]
    for k, v in tm.state_dict().items():
        assert_close(weights[k], v, k)
    for i, entry in t_state["state"].items():
        assert set(exported["state"][i]) == set(entry)
        for k, v in entry.items():
            assert_close(exported["state"][i][k], v, f"state {i} {k}")
    assert exported["param_groups"][0]["params"] == t_state["param_groups"][0]["params"]
    # torch loads the sf export into a fresh optimizer; one more step on each side agrees
    topt2 = torch.optim.AdamW(tm.parameters(), lr=0.5, amsgrad=True, foreach=False)
    topt2.load_state_dict(exported)
    torch_train(tm, topt2, 1, first_step=2)
    for k, v in tm.state_dict().items():
        assert_close(resumed[k], v, f"{k} after resuming")
    assert step == 3 and layout_ok


@pytest.mark.parametrize("layout_name", ["dp", "tp", "zero", "hybrid"])
def test_gradient_accumulation_equals_one_big_batch(layout_name):
    def body():
        sf.manual_seed(0)
        m = sf_mlp()
        pl, x_sbp, rules = layout(layout_name)
        sf.parallel.apply(m, pl, rules)
        x, t = batch(0, n=8)
        sf_loss(m, pl, x_sbp, x, t).backward()
        big = {n: p.grad.full_tensor().clone() for n, p in m.named_parameters()}
        m.zero_grad()
        for half in (slice(0, 4), slice(4, 8)):
            (sf_loss(m, pl, x_sbp, x[half], t[half]) * 0.5).backward()
        acc = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        return big, acc

    big, acc = sf.launch(body, world_size=4)[0]
    for n in big:
        assert_close(acc[n], big[n], n, rtol=1e-12, atol=1e-14)
        assert not torch.all(big[n] == 0)


class _Counting(sf.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


@pytest.mark.parametrize("layout_name", ["dp", "tp", "hybrid", "zero"])
def test_activation_checkpointing_recomputes_and_gives_identical_grads(layout_name):
    def body(ckpt):
        sf.manual_seed(0)
        m = _Counting(sf_mlp(dropout=0.3))
        pl, x_sbp, rules = layout(layout_name)
        sf.parallel.apply(m, pl, rules)
        x_full, t_full = batch(0)
        sf.manual_seed(7)
        x, t = sf.tensor(x_full, pl, x_sbp), sf.tensor(t_full, pl, x_sbp)
        sf.comm.reset_stats()
        saved = [0]

        def pack(tensor):
            saved[0] += 1
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = sf.nn.checkpoint(m, x) if ckpt else m(x)
        n_saved = saved[0]
        loss = ((y - t) ** 2).mean()
        loss.backward()
        sent = sf.comm.stats().sent
        return (loss.item(), {n: p.grad.full_tensor() for n, p in m.named_parameters()},
                m.calls, n_saved, sent)

    loss, grads, calls, saved, sent = sf.launch(body, world_size=4, args=(False,))[0]
    c_loss, c_grads, c_calls, c_saved, c_sent = sf.launch(body, world_size=4, args=(True,))[0]
    assert calls == 1 and c_calls == 2  # recomputed in backward
    assert c_saved < saved
    if layout_name == "zero":  # the weights' all-gathers run again in the recomputation
        assert c_sent > sent
    assert loss == c_loss
    for n in grads:
        assert torch.equal(grads[n], c_grads[n]), n


def test_bf16_autocast_matches_torch_autocast():
    def body():
        sf.manual_seed(0)
        m = sf.nn.Sequential(sf.nn.Linear(5, 10), sf.nn.GELU(), sf.nn.Linear(10, 3))
        sd0 = m.state_dict()
        pl, x_sbp, rules = layout("hybrid")
        sf.parallel.apply(m, pl, rules)
        x_full, t_full = (v.float() for v in batch(0))
        with sf.autocast(dtype=torch.bfloat16):
            y = m(sf.tensor(x_full, pl, x_sbp))
            loss = ((y.float() - sf.tensor(t_full, pl, x_sbp)) ** 2).mean()
        loss.backward()
        return (sd0, y.dtype, y.full_tensor(), loss.item(),
                {n: p.grad.full_tensor() for n, p in m.named_parameters()})

    sd0, y_dtype, y, loss, grads = sf.launch(body, world_size=4)[0]
    tm = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.GELU(), torch.nn.Linear(10, 3))
    tm.load_state_dict(sd0)
    x_full, t_full = (v.float() for v in batch(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = tm(x_full)
        ref_loss = ((ref.float() - t_full) ** 2).mean()
    ref_loss.backward()
    assert y_dtype == ref.dtype == torch.bfloat16
    # bf16: the row-parallel layer reduces bf16 partial sums (torch accumulates inside one
    # matmul), so only bf16-level agreement is expected
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert abs(loss - ref_loss.item()) < 1e-2 * abs(ref_loss.item())
    for n, p in tm.named_parameters():
        assert grads[n].dtype == torch.float32
        torch.testing.assert_close(grads[n], p.grad, rtol=3e-2, atol=3e-3, msg=n)


def test_bf16_autocast_with_ranks_outside_the_placement():
    """A rank outside an op's placement holds an empty shard of the autocast dtype too, so
    later boxing that includes it agrees on the dtype."""
    def body():
        pl = sf.placement("cpu", [0, 1])
        w = sf.randn(4, 3, placement=pl, sbp=sf.B, seed=1, requires_grad=True)
        x = sf.randn(6, 3, placement=pl, sbp=sf.S(0), seed=2)
        with sf.autocast(dtype=torch.bfloat16):
            y = sf.nn.functional.linear(x, w)
        return y.full_tensor().dtype

    assert sf.launch(body, world_size=3) == [torch.bfloat16] * 3


class _TwoStages(sf.nn.Module):
    """fc1 on ranks 0-1, fc2 on ranks 2-3 (pipeline-style placements): each rank holds empty
    shards of the other stage's parameters."""

    def __init__(self):
        super().__init__()
        self.fc1 = sf.nn.Linear(5, 10, dtype=F64)
        self.fc2 = sf.nn.Linear(10, 3, dtype=F64)
        self.p1, self.p2 = sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])

    def forward(self, x):
        return self.fc2(self.fc1(x).relu().to_global(self.p2, sf.S(0)))


def test_parameters_on_disjoint_placements():
    def body():
        sf.manual_seed(0)
        m = _TwoStages()
        sd0 = m.state_dict()
        sf.parallel.apply(m.fc1, m.p1, {"*": sf.B})
        sf.parallel.apply(m.fc2, m.p2, {"weight": sf.S(1), "*": sf.B})
        opt = sf.optim.Adam(m.parameters(), lr=0.02, weight_decay=0.01)
        losses, norms = [], []
        for step in range(3):
            opt.zero_grad()
            x_full, t_full = batch(step)
            x, t = sf.tensor(x_full, m.p1, sf.S(0)), sf.tensor(t_full, m.p2, sf.S(0))
            loss = ((m(x) - t) ** 2).mean()
            loss.backward()
            norms.append(float(sf.optim.clip_grad_norm_(m.parameters(), 0.5)))
            opt.step()
            losses.append(loss.item())
        return sd0, losses, norms, m.state_dict()

    res = sf.launch(body, world_size=4)
    sd0, losses, norms, sd = res[0]
    assert all(r[1] == losses and r[2] == norms for r in res)  # every rank agrees
    tm = torch_mlp()
    tm.load_state_dict({k.replace("fc1", "0").replace("fc2", "2"): v for k, v in sd0.items()})
    t_losses, t_norms = torch_train(tm, torch.optim.Adam(tm.parameters(), lr=0.02,
                                                         weight_decay=0.01, foreach=False), 3)
    assert_close(losses, t_losses, "losses")
    assert_close(norms, t_norms, "norms")
    for k, v in tm.state_dict().items():
        assert_close(sd[k.replace("0.", "fc1.").replace("2.", "fc2.")], v, k)


def test_bucketed_all_reduce_moves_the_same_bytes_as_one_per_parameter():
    """Coalescing the data-parallel gradient all-reduces changes the message count, not the
    bytes: they equal the sum of every parameter's own P -> B plan."""
    def body():
        sf.manual_seed(0)
        m = sf_mlp()
        pl, x_sbp, rules = layout("dp")
        sf.parallel.apply(m, pl, rules)
        opt = sf.optim.SGD(m.parameters(), lr=0.1)
        sf_loss(m, pl, x_sbp, *batch(0)).backward()
        sf.comm.reset_stats()
        opt.step()
        planned = sum(sf.boxing.plan(p.shape, p.dtype, (pl, sf.P), (pl, sf.B)).nbytes
                      for p in m.parameters())
        return sf.comm.stats()["all_reduce"].sent, planned
    res = sf.launch(body, world_size=4)
    assert sum(r[0] for r in res) == res[0][1]


@pytest.mark.parametrize("kw", [dict(), dict(weight_decay=0.1), dict(momentum=0.9),
                                dict(momentum=0.9, dampening=0.3, weight_decay=0.05),
                                dict(momentum=0.9, nesterov=True, maximize=True)])
def test_sgd_multi_tensor_equals_single_tensor_and_torch(kw):
    """SGD's default multi-tensor update gives the single-tensor form's values bit for bit, and
    torch's single-tensor SGD's, over steps (the momentum buffers made, then updated), with
    parameters of two dtypes in one group; the gradients are left as backward wrote them."""
    g = torch.Generator().manual_seed(0)
    inits = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g),
             torch.randn(4, 2, generator=g).double()]
    grads = [[torch.randn(t.shape, generator=g, dtype=t.dtype) for t in inits] for _ in range(3)]

    def body():
        pl = sf.placement("cpu", [0])
        out = []
        for foreach in (True, False):
            ps = [sf.tensor(t.clone(), pl, sf.B).requires_grad_() for t in inits]
            opt = sf.optim.SGD(ps, lr=0.1, foreach=foreach, **kw)
            for step in grads:
                for p, gr in zip(ps, step):
                    p.local.grad = gr.clone()
                opt.step()
                assert all(torch.equal(p.local.grad, gr) for p, gr in zip(ps, step))
            out.append([p.local.detach().clone() for p in ps])
        return out

    multi, single = sf.launch(body, world_size=1)[0]
    tps = [t.clone().requires_grad_() for t in inits]
    topt = torch.optim.SGD(tps, lr=0.1, foreach=False, **kw)
    for step in grads:
        for p, gr in zip(tps, step):
            p.grad = gr.clone()
        topt.step()
    for m, s, t in zip(multi, single, tps):
        assert m.dtype == t.dtype
        assert torch.equal(m, s) and torch.equal(m, t.detach())


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_one_device_step_needs_no_boxing_and_equals_torch(opt_name, monkeypatch):
    """Parameters on one device take the step without boxed gradients (`boxed_grads` is never
    called): gradients clipped first (the clip's remembered results then dropped), the state
    saved and loaded into a new optimizer midway, the same values as torch's."""
    make_sf, make_torch = OPTIMIZERS[opt_name]
    g = torch.Generator().manual_seed(3)
    inits = [torch.randn(6, 4, generator=g), torch.randn(4, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in inits] for _ in range(4)]

    def refuse(*_a, **_k):
        raise AssertionError("a one-device step boxed its gradients")
    monkeypatch.setattr(sf.optim.optimizer, "boxed_grads", refuse)
    # (an earlier test's ZeRO layouts set these for the process; this world has none)
    from sbpflow import param_state
    monkeypatch.setitem(param_state._EVER, "update_layout", False)
    monkeypatch.setitem(param_state._EVER, "backfill", False)

    def body():
        pl = sf.placement("cpu", [0])
        ps = [sf.tensor(t.clone(), pl, sf.B).requires_grad_() for t in inits]
        opt = make_sf(ps)
        for k, step in enumerate(grads):
            if k == 2:
                sd = opt.state_dict()
                opt = make_sf(ps)
                opt.load_state_dict(sd)
            for p, gr in zip(ps, step):
                p.local.grad = gr.clone()
            sf.optim.clip_grad_norm_(ps, 1.0)
            opt.step()
        return [p.local.detach().clone() for p in ps]

    got = sf.launch(body, world_size=1)[0]
    tps = [t.clone().requires_grad_() for t in inits]
    topt = make_torch(tps)
    for step in grads:
        for p, gr in zip(tps, step):
            p.grad = gr.clone()
        torch.nn.utils.clip_grad_norm_(tps, 1.0)
        topt.step()
    for mine, theirs in zip(got, tps):
        torch.testing.assert_close(mine, theirs.detach())  # (float32: the default tolerance)
