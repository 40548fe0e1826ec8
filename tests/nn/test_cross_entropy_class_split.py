"""Cross-entropy of class-split logits (model-parallel softmax, issue 18 part 3): the loss and
the logits' gradient equal torch's (float64) with class weights, ignore_index, label smoothing
and every reduction, on 1-D and 2x2 meshes (classes split once, twice, or with the rows); the
backward runs no collective, where writing the log-sum-exp as plain ops (an all-reduced exp-sum)
all-reduces its per-row gradient: one vector of N rows, two with label smoothing."""

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf
import sbpflow.nn.functional as SF
from sbpflow.tensor import apply_op

S, B = sf.S, sf.B
N, C = 7, 11


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, C, dtype=torch.float64, generator=g) * 3
    target = torch.randint(0, C, (N,), generator=g)
    target[2] = target[5] = -100
    weight = torch.rand(C, dtype=torch.float64, generator=g) + 0.5
    upstream = torch.randn(N, dtype=torch.float64, generator=g)  # for reduction="none"
    return logits, target, weight, upstream


OPTIONS = [dict(reduction=r, label_smoothing=e, weighted=w)
           for r in ("mean", "sum", "none") for e in (0.0, 0.2) for w in (False, True)]
# (logits' nd-sbp, target's nd-sbp): the class axis is axis 1
LAYOUTS = {
    "1d": ([0, 1, 2], [((S(1),), (B,))]),
    "1d4": ([0, 1, 2, 3], [((S(1),), (B,))]),
    "2x2": ([[0, 1], [2, 3]], [((S(1), S(1)), (B, B)), ((S(0), S(1)), (S(0), B)),
                               ((S(1), S(0)), (B, S(0))), ((B, S(1)), (B, B))]),
}


def _torch_ref(logits, target, weight, upstream, opt):
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x, target, weight=weight if opt["weighted"] else None,
                           reduction=opt["reduction"], label_smoothing=opt["label_smoothing"])
    (loss * upstream).sum().backward() if loss.ndim else loss.backward()
    return loss.detach(), x.grad


def _sf_run(ranks, cases, data):
    """Per case: (loss, logits' gradient, backward's all-reduce calls, backward's bytes)."""
    logits, target, weight, upstream = data
    pl = sf.placement("cpu", ranks)
    out = []
    for (lg_sbp, t_sbp), opt in cases:
        x = sf.tensor(logits, pl, lg_sbp).requires_grad_()
        t = sf.tensor(target, pl, t_sbp)
        w = sf.tensor(weight, pl, (B,) * pl.ndim) if opt["weighted"] else None
        loss = SF.cross_entropy(x, t, weight=w, reduction=opt["reduction"],
                                label_smoothing=opt["label_smoothing"])
        value = loss.full_tensor()
        sf.comm.reset_stats()
        if loss.ndim:
            loss.backward(sf.tensor(upstream, pl, (B,) * pl.ndim))
        else:
            loss.backward()
        st = sf.comm.stats()
        out.append((value, x.grad.full_tensor(), st["all_reduce"].calls, st.sent))
    return out


@pytest.mark.parametrize("mesh", list(LAYOUTS))
def test_class_split_cross_entropy_equals_torch_and_backward_is_local(mesh):
    ranks, layouts = LAYOUTS[mesh]
    data = _data()
    cases = [(lay, opt) for lay in layouts for opt in OPTIONS]
    size = sf.placement("cpu", ranks).size
    results = sf.launch(_sf_run, world_size=size, args=(ranks, cases, data))
    bad = []
    for k, (lay, opt) in enumerate(cases):
        ref_loss, ref_grad = _torch_ref(*data, opt)
        loss, grad, _, _ = results[0][k]
        if not torch.allclose(loss, ref_loss, rtol=1e-10, atol=1e-12):
            bad.append(("loss", lay, opt))
        if not torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-12):
            bad.append(("grad", lay, opt, (grad - ref_grad).abs().max().item()))
        calls = [r[k][2] for r in results]
        sent = [r[k][3] for r in results]
        if any(calls) or any(sent):
            bad.append(("backward communicates", lay, opt, calls, sent))
    assert not bad, bad[:6]


def _backward_stats(loss_fn):
    """Rank's backward all-reduce calls and bytes, and the logits' gradient, of
    ``loss_fn(x, target)`` summed, for (N, C) logits split on the classes over 4 ranks."""
    logits, target, _, _ = _data()
    pl = sf.placement("cpu", [0, 1, 2, 3])
    x = sf.tensor(logits, pl, S(1)).requires_grad_()
    loss = loss_fn(x, sf.tensor(target, pl, B))
    sf.comm.reset_stats()
    loss.backward()
    st = sf.comm.stats()
    return st["all_reduce"].calls, st.sent, x.grad.full_tensor()


def _plain_ops_loss(smoothing: float):
    """The summed class-split cross-entropy written with plain ops (as sbpflow did before): the
    exp-sum all-reduced to B, then its log; the target logit picked (a partial sum)."""
    def loss(x, t):
        z = x - x.detach().amax(dim=1, keepdim=True).to_global(sbp=(B,))
        lse = z.exp().sum(1).to_global(sbp=(B,)).log()
        rows = (lse - apply_op("pick_class", z, t)) * t.ne(-100).to(x.dtype)
        if smoothing:
            smooth = (lse * float(C) - z.sum(1).to_global(sbp=(B,))) * t.ne(-100).to(x.dtype)
            rows = rows * (1 - smoothing) + smooth * (smoothing / C)
        return rows.sum()
    return loss


def test_the_backward_all_reduce_removed_is_the_exp_sums():
    """Written with plain ops, the backward all-reduces the exp-sum's gradient (an N-row
    vector; with label smoothing the sum over the classes' too); sbpflow's cross-entropy,
    same value and gradient, sends nothing in backward."""
    def body():
        out = []
        for eps in (0.0, 0.2):
            old = _backward_stats(_plain_ops_loss(eps))
            new = _backward_stats(lambda x, t, e=eps: SF.cross_entropy(
                x, t, reduction="sum", label_smoothing=e))
            out.append((old, new))
        # the bytes of one all-reduce of an N-row float64 vector
        rows = sf.zeros(N, placement=sf.placement("cpu", [0, 1, 2, 3]), sbp=sf.P,
                        dtype=torch.float64)
        sf.comm.reset_stats()
        rows.to_global(sbp=B)
        return out, sf.comm.stats().sent
    logits, target, _, _ = _data()
    out, row_bytes = sf.launch(body, world_size=4)[0]
    assert row_bytes > 0
    for (eps, ((old_calls, old_sent, old_grad), (new_calls, new_sent, new_grad))) in zip(
            (0.0, 0.2), out):
        ref = logits.clone().requires_grad_()
        F.cross_entropy(ref, target, reduction="sum", label_smoothing=eps).backward()
        assert torch.allclose(old_grad, ref.grad) and torch.allclose(new_grad, ref.grad)
        assert (new_calls, new_sent) == (0, 0)
        assert old_calls == (2 if eps else 1)
        assert old_sent == old_calls * row_bytes, (old_sent, row_bytes)
