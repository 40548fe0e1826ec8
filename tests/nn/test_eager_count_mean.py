"""A mean cross-entropy whose valid-target count is all-reduced without blocking the forward
(sf.nn.eager_count_mean): losses, gradients and weights equal torch's on one device whether the
guessed count is right or wrong, whatever reads the loss first, with gradient accumulation,
retained gradients and the overlapped gradient all-reduces; and the guess is used (no wait
before backward) once the count is stable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf
from sbpflow.nn.eager_count_mean import PendingMean

F64 = torch.float64
IN, OUT, ROWS = 5, 7, 10
IGNORE = -100


def _batch(step: int, ignored: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, IN, generator=g, dtype=F64)
    t = torch.randint(0, OUT, (ROWS,), generator=g)
    t[:ignored] = IGNORE
    return x, t


# the number of ignored targets per step: stable, then a change (a wrong guess), then stable
IGNORED = [0, 0, 0, 0, 3, 3, 3, 0]


def _train(ignored=IGNORED, read_first: str = "", accumulate: bool = False,
           retain: bool | int = False, overlap: bool = True):
    """sf and torch side by side; per step (loss value, loss was a PendingMean), the final
    weights of both. ``read_first``: how the loss is used before backward ("" nothing, "item",
    "derived": backward runs on ``loss * 2`` instead). ``retain``: True, or the one rank that
    retains the hidden layer's gradient (that rank waits for the count, the others guess)."""
    pl = sf.placement("cpu", list(range(sf.world_size())))
    w0 = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(9), dtype=F64)
    w = sf.nn.Parameter(sf.tensor(w0, pl, sf.B))
    wt = w0.clone().requires_grad_()
    opt = sf.optim.SGD([w], lr=0.5, momentum=0.9)
    opt.overlap_grad_sync = overlap
    topt = torch.optim.SGD([wt], lr=0.5, momentum=0.9)
    out = []
    for step, n_ignored in enumerate(ignored):
        opt.zero_grad()
        topt.zero_grad()
        for micro in range(2 if accumulate else 1):
            x, t = _batch(10 * step + micro, n_ignored)
            h = sf.tensor(x, pl, sf.S(0)) @ w
            retained = retain is True or (retain is not False and sf.rank() == retain)
            if retained:
                h.retain_grad()
            loss = sf.nn.functional.cross_entropy(h, sf.tensor(t, pl, sf.S(0)))
            pending = isinstance(loss, PendingMean)
            scale = 1.0
            if read_first == "item":
                out.append(("read", loss.item()))
            elif read_first == "derived":
                loss, scale = loss * 2.0, 2.0
            loss.backward()
            ref = F.cross_entropy(x @ wt, t, ignore_index=IGNORE) * scale
            ref.backward()
            out.append((loss.full_tensor().item(), ref.item(), pending))
            if retained:
                valid = (t != IGNORE)[:, None]
                expect = (F.softmax(x @ wt.detach(), -1) - F.one_hot(t.clamp(min=0), OUT)) \
                    * valid / valid.sum() * scale
                # this rank's rows only: the others do not retain (no collective here)
                out.append(("retained", torch.allclose(
                    h.grad.local, sf.tensor(expect, pl, sf.S(0)).local, rtol=1e-12, atol=1e-15)))
        assert torch.allclose(w.grad.full_tensor(), wt.grad, rtol=1e-12, atol=1e-15), step
        opt.step()
        topt.step()
    return out, w.full_tensor(), wt.detach()


def _check(results):
    for out, w, wt in results:
        assert torch.allclose(w, wt, rtol=1e-12, atol=1e-14)
        for row in out:
            if row[0] == "retained":
                assert row[1]
            elif row[0] != "read":
                assert row[0] == pytest.approx(row[1], rel=1e-13)
    return results[0][0]


def _pending_steps(out) -> list[bool]:
    return [row[2] for row in out if len(row) == 3]


def test_the_count_is_guessed_once_stable_and_a_wrong_guess_is_corrected():
    out = _check(sf.launch(_train, world_size=4))
    # steps 0, 1 wait for the count; 2-4 guess it (4 wrongly: 3 targets ignored); 5 and 6 wait
    # (the last two counts differ, then agree again from 6 on), 7 guesses wrongly again
    assert _pending_steps(out) == [False, False, True, True, True, False, True, True]


@pytest.mark.parametrize("read_first", ["item", "derived"])
def test_reading_or_reusing_the_loss_first_waits_and_stays_exact(read_first):
    out = _check(sf.launch(_train, world_size=4, kwargs=dict(read_first=read_first)))
    if read_first == "item":  # the value read before backward is the exact mean
        values = [row[1] for row in out if row[0] == "read"]
        assert values == pytest.approx([row[1] for row in out if len(row) == 3], rel=1e-13)


def test_accumulated_micro_batches_and_retained_gradients_stay_exact():
    _check(sf.launch(_train, world_size=4, kwargs=dict(accumulate=True)))
    _check(sf.launch(_train, world_size=4, kwargs=dict(retain=True)))
    _check(sf.launch(_train, world_size=4, kwargs=dict(overlap=False)))


def test_a_rank_that_waits_while_the_others_guess_drops_the_same_all_reduces():
    # rank 0 retains a gradient, so it does not guess; on a wrong guess the others correct their
    # gradients, and every rank must redo the overlapped all-reduces (or rank 0 would keep a
    # sum of uncorrected gradients, and wait alone in the others' redone all-reduces)
    results = sf.launch(_train, world_size=4, kwargs=dict(retain=0))
    _check(results)
    assert all(any(row[0] == "retained" for row in r[0]) == (k == 0) for k, r in enumerate(results))


def test_the_count_is_one_scalar_all_reduce_a_step():
    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        w = sf.randn(IN, OUT, placement=pl, sbp=sf.B, dtype=F64, seed=1).requires_grad_()
        calls = []
        for step in range(4):
            x, t = _batch(step, 0)
            h = sf.tensor(x, pl, sf.S(0)) @ w
            sf.comm.reset_stats()
            loss = sf.nn.functional.cross_entropy(h, sf.tensor(t, pl, sf.S(0)))
            loss.backward()
            st = sf.comm.stats().kinds["all_reduce"]
            calls.append((st.calls, st.sent))
            w.grad = None
        return calls
    results = sf.launch(body, world_size=4)
    for step in range(4):
        assert all(r[step][0] == 1 for r in results)
        # a ring all-reduce of one float64 moves 2 (n - 1) * 8 bytes over all ranks
        assert sum(r[step][1] for r in results) == 2 * 3 * 8


@pytest.mark.gloo
def test_torch_backend_wrong_guess_with_overlapped_gradient_all_reduces():
    # a count that changes after being stable: the started gradient all-reduces are dropped on
    # every rank and redone, so the weights stay torch's (and nothing hangs)
    _check(sf.launch(_train, world_size=2, backend="torch",
                     kwargs=dict(ignored=[0, 0, 0, 4, 4, 4, 1, 1])))


def _stable_then(pl, w, opt, counts_after: list, between=None):
    """Three steps with every target valid (the count is then guessed), ``between()``, then a
    step per entry of ``counts_after`` (targets ignored); per later step (loss, torch's loss,
    was a PendingMean)."""
    out = []
    for step, ignored in enumerate([0, 0, 0] + counts_after):
        if step == 3 and between is not None:
            between()
        x, t = _batch(step, ignored)
        loss = sf.nn.functional.cross_entropy(sf.tensor(x, pl, sf.S(0)) @ w,
                                              sf.tensor(t, pl, sf.S(0)))
        pending = isinstance(loss, PendingMean)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= 3:
            out.append((loss.full_tensor().item(), pending))
    return out


def test_a_mean_read_on_one_rank_only_keeps_the_ranks_guessing_alike():
    # an evaluation loss (grad enabled, no backward) whose value only rank 0 reads: every rank
    # still takes its count into the stream's history, so all guess alike at the next step
    # (else the ranks that guessed wrongly redo all-reduces the others do not: a hang)
    def body():
        pl = sf.placement("cpu", [0, 1])
        w = sf.nn.Parameter(sf.tensor(torch.randn(IN, OUT, dtype=F64,
                                                  generator=torch.Generator().manual_seed(3)),
                                      pl, sf.B))
        opt = sf.optim.SGD([w], lr=0.1)

        def evaluate():
            x, t = _batch(99, 3)
            ev = sf.nn.functional.cross_entropy(sf.tensor(x, pl, sf.S(0)) @ w,
                                                sf.tensor(t, pl, sf.S(0)))
            if sf.rank() == 0:
                float(ev.local.detach())

        return _stable_then(pl, w, opt, [5, 0], evaluate), w.full_tensor()

    results = sf.launch(body, world_size=2)
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])
    # the evaluation's count (7 valid) broke the run of equal counts: the next step waits
    assert [pending for _, pending in results[0][0]] == [False, False]


def test_a_hook_on_a_leaf_makes_backward_wait_for_the_count():
    # a non-linear hook sees the gradient: after a wrong guess it could not be corrected
    def body(with_hook):
        pl = sf.placement("cpu", [0, 1])
        w = sf.nn.Parameter(sf.tensor(torch.randn(IN, OUT, dtype=F64,
                                                  generator=torch.Generator().manual_seed(3)),
                                      pl, sf.B))
        if with_hook:
            w.local.register_hook(lambda g: g.clamp(-0.01, 0.01))
        opt = sf.optim.SGD([w], lr=0.1)
        _stable_then(pl, w, opt, [4])
        return w.full_tensor()

    hooked = sf.launch(body, world_size=2, args=(True,))[0]
    plain = sf.launch(body, world_size=2, args=(False,))[0]
    assert not torch.allclose(hooked, plain)       # the hook did act
    torch.testing.assert_close(hooked, _clamped_per_rank_sgd(), rtol=1e-12, atol=1e-14)


def _clamped_per_rank_sgd() -> torch.Tensor:
    """torch's SGD where each of 2 ranks' hooks clamps its half-batch partial gradient."""
    w = torch.randn(IN, OUT, dtype=F64, generator=torch.Generator().manual_seed(3))
    for step, ignored in enumerate([0, 0, 0, 4]):
        x, t = _batch(step, ignored)
        n = int((t != IGNORE).sum())
        g = torch.zeros_like(w)
        for rows in (slice(0, 5), slice(5, 10)):
            wr = w.clone().requires_grad_()
            F.cross_entropy(x[rows] @ wr, t[rows], ignore_index=IGNORE,
                            reduction="sum").backward()
            g += (wr.grad / n).clamp(-0.01, 0.01)
        w = w - 0.1 * g
    return w


def test_bf16_mean_keeps_torchs_dtype_and_copies_as_a_plain_tensor():
    import copy
    import pickle

    def body():
        pl = sf.placement("cpu", [0, 1])
        w = sf.tensor(torch.randn(IN, OUT, generator=torch.Generator().manual_seed(3)),
                      pl, sf.B).to(torch.bfloat16).requires_grad_()
        out = []
        for step in range(4):
            x, t = _batch(step, 0)
            loss = sf.nn.functional.cross_entropy(
                sf.tensor(x.to(torch.bfloat16), pl, sf.S(0)) @ w, sf.tensor(t, pl, sf.S(0)))
            kind, dtype = type(loss).__name__, loss.dtype
            copied = type(copy.copy(loss)).__name__
            unpickled = pickle.loads(pickle.dumps(loss.detach()))
            out.append((kind, dtype, copied, type(unpickled).__name__,
                        torch.equal(unpickled.local, loss.local.detach())))
            loss.backward()
            w.grad = None
        return out

    out = sf.launch(body, world_size=2)[0]
    assert [row[0] for row in out] == ["GlobalTensor", "GlobalTensor", "PendingMean",
                                       "PendingMean"]
    for kind, dtype, copied, unpickled, same in out:
        assert dtype == torch.bfloat16                 # as torch: the logits' dtype
        assert copied == unpickled == "GlobalTensor" and same


def test_guessing_can_be_switched_off(monkeypatch):
    from sbpflow.nn import eager_count_mean
    monkeypatch.setattr(eager_count_mean, "guess_counts", False)   # every rank thread sees it
    out = _check(sf.launch(_train, world_size=2, kwargs=dict(ignored=[0] * 5)))
    assert not any(_pending_steps(out))
