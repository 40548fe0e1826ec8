"""Transformer ops of sf.nn.functional: softmax / log_softmax, layer_norm, embedding,
cross_entropy, dropout, scaled_dot_product_attention.

Registered ops: every signature (``signature_layouts``). Composites along a split axis: explicit
layouts (S on the reduced / normalized / class axis, on other axes, B, P, 2x2 combinations).
1-D mesh of 3 ranks and the 2x2 mesh, float64, uneven sizes; forward equals torch and the
gradient of every float input equals torch's.
"""

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf
import sbpflow.nn.functional as SF
from sbpflow.tensor import apply_op
from sbptest import check_op, make_global, signature_layouts

MESHES = [[0, 1, 2], [[0, 1], [2, 3]]]
S, B, P = sf.S, sf.B, sf.P


def _t(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _ints(high, *shape, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _launch(ranks, body):
    pl = sf.placement("cpu", ranks)
    return sf.launch(lambda: body(pl), world_size=pl.size)[0]


def _lay(pl, one_d, two_d):
    """Layouts (one nd-sbp per tensor input) for a 1-D or a 2-D mesh."""
    return one_d if pl.ndim == 1 else two_d


# -- registered ops: every signature --------------------------------------------------------------
@pytest.mark.parametrize("ranks", MESHES)
def test_registered_ops_every_signature(ranks):
    x3 = _t(5, 7, 4)
    tgt = _ints(7, 5, 3, seed=3)
    tgt[0, 0] = -100
    causal = torch.ones(7, 5, dtype=torch.bool).triu(1)

    def pick_ref(logits, target):
        keep = target != -100
        return logits.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep

    cases = [
        ("softmax", lambda x, d: apply_op("softmax", x, d), torch.softmax, (x3, 1)),
        ("log_softmax", lambda x, d: apply_op("log_softmax", x, d), torch.log_softmax, (x3, -1)),
        ("layer_norm", lambda *a: apply_op("layer_norm", *a), F.layer_norm,
         (x3, (7, 4), _t(7, 4, seed=1), _t(7, 4, seed=2), 1e-5)),
        ("layer_norm", lambda *a: apply_op("layer_norm", *a), F.layer_norm,
         (x3, (4,), _t(4, seed=1), None, 1e-5)),
        ("embedding", lambda i, w: apply_op("embedding", i, w), F.embedding,
         (_ints(11, 5, 3, seed=4), _t(11, 7))),
        ("embedding", lambda i, w, p: apply_op("embedding", i, w, p), F.embedding,
         (_ints(11, 5, seed=4), _t(11, 7), 4)),
        ("masked_fill_causal", lambda x: apply_op("masked_fill_causal", x, 0.5),
         lambda x: x.masked_fill(causal, 0.5), (_t(3, 7, 5),)),
        ("pick_class", lambda lg, t: apply_op("pick_class", lg, t), pick_ref, (_t(5, 3, 7), tgt)),
        ("row_cross_entropy", lambda lg, t: apply_op("row_cross_entropy", lg, t),
         lambda lg, t: F.cross_entropy(lg.reshape(-1, 7), t.reshape(-1),
                                       reduction="none").view(t.shape), (_t(5, 3, 7), tgt)),
        ("cross_entropy_sum", lambda lg, t: apply_op("cross_entropy_sum", lg, t),
         lambda lg, t: (F.cross_entropy(lg.reshape(-1, 7), t.reshape(-1), reduction="sum"),
                        (t != -100).sum().to(lg.dtype)), (_t(5, 3, 7), tgt)),
        ("cross_entropy_mean", lambda lg, t: apply_op("cross_entropy_mean", lg, t),
         lambda lg, t: F.cross_entropy(lg.reshape(-1, 7), t.reshape(-1)), (_t(5, 3, 7), tgt)),
        ("attention", lambda a, b, c: apply_op("attention", a, b, c, is_causal=True),
         lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
         (_t(3, 5, 4, 2), _t(3, 5, 4, 2, seed=1), _t(3, 5, 4, 2, seed=2))),
    ]

    def body(pl):
        failures = []
        for name, sf_fn, ref, args in cases:
            layouts = signature_layouts(name, args, pl)
            failures += [(name,) + f for f in check_op(sf_fn, ref, args, pl, layouts)]
        return failures

    assert not _launch(ranks, body)


def test_vocab_parallel_embedding_is_local_and_partial():
    def body(pl):
        ids = sf.tensor(_ints(10, 4, 5), pl, (S(0), B))
        w = sf.tensor(_t(10, 6), pl, (B, S(0)), requires_grad=True)  # a parameter stays put
        sf.comm.reset_stats()
        y = SF.embedding(ids, w)
        sent = sf.comm.stats().sent
        return y.sbp, sent, torch.equal(y.full_tensor(), F.embedding(_ints(10, 4, 5), _t(10, 6)))
    sbp, sent, ok = _launch([[0, 1], [2, 3]], body)
    assert sbp == (S(0), P) and sent == 0 and ok


# -- softmax / log_softmax along a split axis -----------------------------------------------------
@pytest.mark.parametrize("ranks", MESHES)
def test_softmax_composite(ranks):
    x = _t(4, 3, 7)

    def body(pl):
        layouts = _lay(pl, [(S(2),), (S(0),), (B,), (P,)],
                       [((S(2), S(0)),), ((S(0), S(2)),), ((S(2), S(2)),), ((B, S(2)),),
                        ((P, S(2)),), ((S(1), S(0)),)])
        failures = []
        for fn, ref in ((SF.softmax, torch.softmax), (SF.log_softmax, torch.log_softmax)):
            failures += check_op(fn, ref, (x, -1), pl, layouts)
            failures += check_op(fn, ref, (x, 2), pl, layouts)
        # the split axis stays split: no gather of x, only the two (N, 1) all-reduces
        g = sf.tensor(x, pl, _lay(pl, (S(2),), (S(0), S(2))))
        y = SF.softmax(g, -1)
        failures += [] if y.sbp == g.sbp else [("layout", y.sbp)]
        # the unsplit axis: the registered op, no communication
        h = sf.tensor(x, pl, _lay(pl, (S(0),), (S(0), S(1))))
        sf.comm.reset_stats()
        y, z = SF.softmax(h, 2), h.log_softmax(2)
        failures += [] if sf.comm.stats().sent == 0 and y.sbp == h.sbp == z.sbp else [("comm",)]
        failures += [] if torch.allclose(z.full_tensor(), torch.log_softmax(x, 2)) else [("meth",)]
        return failures

    assert not _launch(ranks, body)


# -- layer_norm over a split hidden dim -----------------------------------------------------------
@pytest.mark.parametrize("ranks", MESHES)
def test_layer_norm_composite(ranks):
    x, w, b = _t(4, 3, 10), _t(10, seed=1), _t(10, seed=2)
    x2, w2 = _t(4, 5, 7), _t(5, 7, seed=3)

    def body(pl):
        ln = lambda t, wt, bs: SF.layer_norm(t, (10,), wt, bs, 1e-5)  # noqa: E731
        ref = lambda t, wt, bs: F.layer_norm(t, (10,), wt, bs, 1e-5)  # noqa: E731
        layouts = _lay(pl, [(S(2), S(0), S(0)), (S(2), B, B), (S(0), B, B), (B, S(0), B),
                            (P, B, B)],
                       [((S(0), S(2)), (B, S(0)), (B, S(0))), ((S(2), S(0)), (S(0), B), (S(0), B)),
                        ((S(2), S(2)), (S(0), S(0)), (S(0), S(0))), ((B, S(2)), (B, B), (B, B)),
                        ((S(1), S(2)), (B, S(0)), (B, B))])
        failures = check_op(ln, ref, (x, w, b), pl, layouts)
        # no affine; and two normalized dims, the first split
        failures += check_op(lambda t: SF.layer_norm(t, 10), lambda t: F.layer_norm(t, (10,)),
                             (x,), pl, [lay[:1] for lay in layouts])
        layouts2 = _lay(pl, [(S(1), S(0)), (S(2), S(1)), (S(0), B)],
                        [((S(1), S(2)), (S(0), S(1))), ((S(0), S(1)), (B, S(0)))])
        failures += check_op(lambda t, wt: SF.layer_norm(t, (5, 7), wt),
                             lambda t, wt: F.layer_norm(t, (5, 7), wt), (x2, w2), pl, layouts2)
        return failures

    assert not _launch(ranks, body)


# -- cross_entropy --------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", MESHES)
def test_cross_entropy(ranks):
    """torch's shapes: (N, C) logits with (N,) targets, and (N, C, d) with (N, d)."""
    n, c = 7, 11
    logits2, target2 = _t(n, c) * 3, _ints(c, n, seed=5)
    logits3, target3 = _t(3, c, 5) * 3, _ints(c, 3, 5, seed=6)
    target3[1, 2] = -100  # ignored, as torch

    def ref_fn(reduction):
        return lambda lg, t: F.cross_entropy(lg, t, reduction=reduction)

    def body(pl):
        last2, cls3 = S(1), S(1)  # the class axis
        lay2 = _lay(pl, [(S(0), S(0)), (last2, B), (B, B), (P, B)],
                    [((S(0), last2), (S(0), B)), ((last2, S(0)), (B, S(0))),
                     ((last2, last2), (B, B)), ((B, last2), (B, B)), ((S(0), S(0)), (S(0), S(0)))])
        lay3 = _lay(pl, [(S(0), S(0)), (S(2), S(1)), (cls3, B), (P, B)],
                    [((S(0), cls3), (S(0), B)), ((S(2), S(0)), (S(1), S(0))),
                     ((cls3, S(2)), (B, S(1))), ((P, cls3), (B, B))])
        failures = []
        for reduction in ("mean", "sum", "none"):
            ce = lambda lg, t, r=reduction: SF.cross_entropy(lg, t, reduction=r)  # noqa: E731
            failures += check_op(ce, ref_fn(reduction), (logits2, target2), pl, lay2)
            failures += check_op(ce, ref_fn(reduction), (logits3, target3), pl, lay3)
        # the loss is a global scalar with a plain backward()
        lg = make_global(logits2, pl, lay2[1][0]).requires_grad_()
        loss = SF.cross_entropy(lg, sf.tensor(target2, pl, lay2[1][1]))
        loss.backward()
        ref_lg = logits2.clone().requires_grad_()
        F.cross_entropy(ref_lg, target2).backward()
        if loss.shape != () or not torch.allclose(lg.grad.full_tensor(), ref_lg.grad):
            failures.append(("scalar backward",))
        return failures

    assert not _launch(ranks, body)


def test_cross_entropy_mean_communicates_only_what_the_layouts_need():
    """Rows split alike (data parallel): one scalar all-reduce, of the valid-target count.
    Rows split with replicated targets (after tensor parallelism): none, the count is local."""
    logits, target = _t(8, 5), _ints(5, 8, seed=2)
    target[3] = -100

    def body(pl):
        out = []
        for t_sbp in (S(0), B):
            lg = sf.tensor(logits, pl, S(0))
            t = sf.tensor(target, pl, t_sbp)
            sf.comm.reset_stats()
            loss = SF.cross_entropy(lg, t)
            st = sf.comm.stats()
            out.append((st.kinds["all_reduce"].calls if "all_reduce" in st.kinds else 0,
                        st.sent, torch.allclose(loss.full_tensor(), F.cross_entropy(logits, target))))
        return out

    (dp_calls, dp_sent, dp_ok), (tp_calls, tp_sent, tp_ok) = _launch([0, 1, 2, 3], body)
    assert (dp_calls, dp_ok) == (1, True) and dp_sent == 3 * 8  # rank 0's share of a float64
    assert (tp_calls, tp_sent, tp_ok) == (0, 0, True)


def test_cross_entropy_mean_of_bf16_logits_counts_exactly():
    """Under bf16 autocast the summed loss is float32; the valid-target count must be too (in
    bf16, 301 rounds to 300)."""
    logits = _t(301, 7).to(torch.bfloat16)
    target = _ints(7, 301, seed=3)
    target[:4] = -100   # 297 valid: not a bf16 value either
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(logits, target)

    def body(pl):
        out = []
        # rows split (the fused kernel), and classes split too (model-parallel softmax)
        for lg_sbp in ((S(0), B), (S(0), S(1))):
            with sf.autocast(dtype=torch.bfloat16):
                loss = SF.cross_entropy(sf.tensor(logits, pl, lg_sbp),
                                        sf.tensor(target, pl, (S(0), B)))
            out.append(loss.full_tensor())
        return out

    for got in _launch([[0, 1], [2, 3]], body):
        assert got.dtype == torch.float32 and ref.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("ranks", MESHES)
def test_cross_entropy_class_weights_and_label_smoothing(ranks):
    n, c = 7, 11
    logits, target = _t(3, c, n) * 3, _ints(c, 3, n, seed=5)   # torch's (N, C, d) form
    target[0, 1] = target[2, 6] = -100
    w = torch.rand(c, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) + 0.5

    def torch_ce(lg, t, wt, reduction, eps, weighted):
        return F.cross_entropy(lg, t, weight=wt if weighted else None, reduction=reduction,
                               label_smoothing=eps)

    def ref_fn(reduction, eps, weighted):
        """torch's formula written out, so the weight's gradient has a reference too (torch's
        kernel is not differentiable in ``weight``); checked equal to torch's kernel below."""
        def ref(lg, t, wt):
            logp = torch.log_softmax(lg, 1)
            valid = (t != -100).to(lg.dtype)
            tc = t.clamp(min=0)
            w_rows = (wt[tc] if weighted else 1.0) * valid
            nll = -logp.gather(1, tc.unsqueeze(1)).squeeze(1)
            wc = wt.view(1, c, 1) if weighted else 1.0
            smooth = -(logp * wc).sum(1) * valid
            loss = (1 - eps) * nll * w_rows + eps / c * smooth
            if reduction == "none":
                return loss
            return loss.sum() if reduction == "sum" else loss.sum() / w_rows.sum()
        assert torch.allclose(ref(logits, target, w),
                              torch_ce(logits, target, w, reduction, eps, weighted))
        return ref

    def body(pl):
        lay = _lay(pl, [(S(0), S(0), B), (S(1), B, S(0)), (B, B, B), (S(2), S(1), B)],
                   [((S(0), S(1)), (S(0), B), (B, S(0))), ((S(1), S(2)), (B, S(1)), (S(0), B)),
                    ((S(1), S(1)), (B, B), (B, B)), ((S(2), B), (S(1), B), (B, B))])
        failures = []
        for reduction in ("mean", "sum", "none"):
            for eps, weighted in ((0.2, False), (0.0, True), (0.2, True)):
                def ce(lg, t, wt, r=reduction, e=eps, wd=weighted):
                    return SF.cross_entropy(lg, t, weight=wt if wd else None, reduction=r,
                                            label_smoothing=e)
                failures += [(reduction, eps, weighted) + f for f in check_op(
                    ce, ref_fn(reduction, eps, weighted), (logits, target, w), pl, lay)]
        x, t = sf.tensor(logits, pl, lay[0][0]), sf.tensor(target, pl, lay[0][1])
        with pytest.raises(sf.SbpError, match="weight of shape"):
            SF.cross_entropy(x, t, weight=sf.tensor(w[:5], pl, (B,) * pl.ndim))
        with pytest.raises(ValueError, match="label_smoothing"):
            SF.cross_entropy(x, t, label_smoothing=1.5)
        with pytest.raises(sf.SbpError, match=r"classes on axis 1.*reshape\(-1, C\)"):
            SF.cross_entropy(x.permute(0, 2, 1), t)   # (B, T, C) logits: torch's error too
        return failures

    assert not _launch(ranks, body)


# -- dropout --------------------------------------------------------------------------------------
def test_dropout_same_mask_in_every_layout():
    x = _t(37, 29)
    up = _t(37, 29, seed=9)

    def run(pl, layouts):
        out = []
        for nd in layouts:
            g = make_global(x, pl, nd).requires_grad_()
            y = SF.dropout(g, 0.3, seed=123)
            y.backward(sf.tensor(up, pl, (B,) * pl.ndim))
            out.append((y.full_tensor(), g.grad.full_tensor()))
        return out

    (ref_y, ref_g), = _launch([0], lambda pl: run(pl, [(B,)]))
    dropped = (ref_y == 0).double().mean().item()
    assert abs(dropped - 0.3) < 0.05
    kept = ref_y != 0
    assert torch.equal(ref_y[kept], x[kept] * (1 / (1 - 0.3)))  # torch's scaling: x * (1/(1-p))
    assert torch.equal(ref_g, up * (kept.double() / (1 - 0.3)))
    one_d = [(S(0),), (S(1),), (B,), (P,)]
    two_d = [(S(0), S(1)), (S(1), S(0)), (S(0), S(0)), (B, S(1)), (P, S(0))]
    results = _launch([0, 1, 2], lambda pl: run(pl, one_d)) + \
        _launch([[0, 1], [2, 3]], lambda pl: run(pl, two_d))
    for (y, g), lay in zip(results, one_d + two_d):
        if P in lay:  # parts summed in another order: equal to rounding
            assert torch.allclose(y, ref_y, rtol=1e-12, atol=1e-12), lay
        else:
            assert torch.equal(y, ref_y), lay
        assert torch.equal(g, ref_g), lay


def test_dropout_default_seed_and_eval():
    def body(pl):
        sf.manual_seed(7)
        g = sf.tensor(torch.ones(64, 64, dtype=torch.float64), pl, S(0))
        a, b = SF.dropout(g, 0.5), SF.dropout(g, 0.5)
        same = SF.dropout(g, 0.5, training=False) is g
        return a.full_tensor(), b.full_tensor(), same
    a, b, same = _launch([0, 1, 2], body)
    assert same and not torch.equal(a, b)
    assert abs((a == 0).double().mean().item() - 0.5) < 0.05
    assert set(a.unique().tolist()) == {0.0, 2.0}
    a1, _, _ = _launch([0], body)  # the per-rank stream agrees with one device
    assert torch.equal(a, a1)


# -- attention ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", MESHES)
def test_causal_attention(ranks):
    q, k, v = _t(4, 5, 6, 3), _t(4, 5, 6, 3, seed=1), _t(4, 5, 6, 3, seed=2)

    def ref(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    def sdpa(a, b, c):
        return SF.scaled_dot_product_attention(a, b, c, is_causal=True)

    def body(pl):
        every = lambda nd: (nd, nd, nd)  # noqa: E731
        local = _lay(pl, [every((S(0),)), every((S(1),))],
                     [every((S(0), S(1))), every((S(1), S(0))), every((S(1), S(1)))])
        other = _lay(pl, [every((B,)), ((S(2),), (B,), (B,)), ((B,), (S(2),), (S(2),))],
                     [((S(0), S(2)), (S(0), B), (S(0), B)),
                      ((S(1), B), (S(1), S(2)), (S(1), S(2)))])
        failures = check_op(sdpa, ref, (q, k, v), pl, local + other)
        # heads / batch split: no communication at all, forward or backward
        for lay in local:
            ts = [sf.tensor(t, pl, nd).requires_grad_() for t, nd in zip((q, k, v), lay)]
            sf.comm.reset_stats()
            y = sdpa(*ts)
            y.backward(sf.tensor(torch.ones(4, 5, 6, 3, dtype=torch.float64), pl, y.sbp))
            if sf.comm.stats().sent or y.sbp != lay[0]:
                failures.append(("communicates", lay, y.sbp))
            if "ScaledDotProduct" not in type(y.local.grad_fn).__name__:   # torch's fused kernel
                failures.append(("not fused", lay, type(y.local.grad_fn).__name__))
        # a boolean mask equals the causal flag
        mask = sf.tensor(torch.ones(6, 6, dtype=torch.bool).tril(), pl, (B,) * pl.ndim)
        ts = [sf.tensor(t, pl, nd) for t, nd in zip((q, k, v), local[0])]
        y = SF.scaled_dot_product_attention(*ts, attn_mask=mask)
        if not torch.allclose(y.full_tensor(), ref(q, k, v)):
            failures.append(("bool mask",))
        return failures

    assert not _launch(ranks, body)


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("additive", [False, True], ids=["bool", "float"])
def test_attention_rows_with_every_key_masked_are_zero_as_torch(ranks, additive):
    """A query that may attend to no key (a left-padded position under a causal and padding
    mask, as Hugging Face's masks give) gets zeros and a zero gradient, as torch's SDPA; its
    softmax over only -inf scores gave NaN, in the values and in every gradient."""
    q, k, v = _t(4, 5, 6, 3), _t(4, 5, 6, 3, seed=1), _t(4, 5, 6, 3, seed=2)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    allowed[:2] = False                       # rows 0 and 1 attend to nothing
    mask = torch.zeros(6, 6, dtype=torch.float64).masked_fill(~allowed, float("-inf")) \
        if additive else allowed

    def ref(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, attn_mask=mask)

    def body(pl):
        m = sf.tensor(mask, pl, (B,) * pl.ndim)

        def sdpa(a, b, c):
            return SF.scaled_dot_product_attention(a, b, c, attn_mask=m)
        every = lambda nd: (nd, nd, nd)  # noqa: E731
        layouts = _lay(pl, [every((S(0),)), every((B,)), ((B,), (S(2),), (S(2),))],
                       [every((S(0), S(1))), ((S(1), B), (S(1), S(2)), (S(1), S(2)))])
        return check_op(sdpa, ref, (q, k, v), pl, layouts)

    assert not torch.isnan(ref(q, k, v)).any()
    assert not _launch(ranks, body)


def test_more_ranks_than_classes_or_rows():
    """Empty shards: 2 classes / 2 vocab rows / 2 batch rows over 3 ranks."""
    logits, target = _t(4, 2), torch.tensor([0, 1, 1, 0])
    ids, table = torch.tensor([[0, 1], [1, 1]]), _t(2, 3, seed=1)
    w, b = _t(2, seed=2), _t(2, seed=3)

    def body(pl):
        f = check_op(SF.cross_entropy, F.cross_entropy, (logits, target), pl,
                     [(S(1), B), (S(0), S(0))])
        f += check_op(SF.cross_entropy, F.cross_entropy, (logits[0], target[0]), pl, [(S(0), B)])
        f += check_op(SF.log_softmax, torch.log_softmax, (logits, 1), pl, [(S(1),)])
        f += check_op(lambda x, wt, bs: SF.layer_norm(x, (2,), wt, bs),
                      lambda x, wt, bs: F.layer_norm(x, (2,), wt, bs), (logits, w, b), pl,
                      [(S(1), S(0), S(0))])
        f += check_op(lambda i, t: SF.embedding(i, t, padding_idx=-1),
                      lambda i, t: F.embedding(i, t, padding_idx=-1), (ids, table), pl,
                      [(B, S(0)), (S(0), B)])
        return f

    assert not _launch([0, 1, 2], body)


def test_cross_entropy_loss_module_matches_torch():
    logits, target = _t(6, 5) * 2, _ints(5, 6, seed=3)
    w = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5

    def body():
        pl = sf.placement("cpu", [0, 1])
        crit = sf.nn.CrossEntropyLoss(weight=sf.tensor(w, pl, B), label_smoothing=0.1)
        loss = crit(sf.tensor(logits, pl, S(0)), sf.tensor(target, pl, S(0)))
        return loss.full_tensor(), [n for n, _ in crit.named_buffers()]

    got, buffers = sf.launch(body, world_size=2)[0]
    ref = torch.nn.CrossEntropyLoss(weight=w, label_smoothing=0.1)(logits, target)
    assert torch.allclose(got, ref) and buffers == ["weight"]


def test_bad_arguments_name_the_layouts():
    """Mistakes torch refuses (a softmax dim out of range, a layer_norm weight or bias not of
    normalized_shape, float class-index targets) are `sf.SbpError`s naming the shapes and sbps,
    in every path: the layer_norm check runs before the split-hidden-dim composite, which would
    otherwise fail inside a broadcast ``mul`` / ``add``."""
    x, lg = _t(4, 6), _t(4, 5)
    for refused in (lambda: torch.softmax(x, dim=2), lambda: torch.log_softmax(x, dim=-3),
                    lambda: F.layer_norm(x, (6,), weight=_t(5)),
                    lambda: F.layer_norm(x, (6,), bias=_t(6, 1)),
                    lambda: F.cross_entropy(lg, _t(4))):
        with pytest.raises((IndexError, RuntimeError)):
            refused()

    def body(pl):
        calls = {"float_target": lambda: SF.cross_entropy(sf.tensor(lg, pl, S(0)),
                                                          sf.tensor(_t(4), pl, B))}
        for sbp in (S(0), S(1)):
            xs = sf.tensor(x, pl, sbp)
            calls[f"softmax {sbp}"] = lambda xs=xs: SF.softmax(xs, dim=2)
            calls[f"log_softmax {sbp}"] = lambda xs=xs: SF.log_softmax(xs, dim=-3)
            calls[f"weight {sbp}"] = lambda xs=xs: SF.layer_norm(
                xs, (6,), weight=sf.tensor(_t(5), pl, B))
            calls[f"bias {sbp}"] = lambda xs=xs: SF.layer_norm(
                xs, (6,), bias=sf.tensor(_t(6, 1), pl, B))
        msgs = {}
        for key, call in calls.items():
            try:
                call()
            except sf.SbpError as e:
                msgs[key] = (type(e).__name__, str(e))
        return msgs
    msgs = _launch([0, 1], body)
    assert len(msgs) == 9, msgs
    for sbp in ("S(0)", "S(1)"):
        for key, shown in (("softmax", "dim 2"), ("log_softmax", "dim -3"),
                           ("weight", "weight of shape (5,)"), ("bias", "bias of shape (6, 1)")):
            kind, text = msgs[f"{key} {sbp}"]
            assert kind == "ShapeError" and shown in text and "(4, 6)" in text, text
            assert f"sbp ({sbp},)" in text and "cpu[0,1]" in text, text
        assert "normalized_shape (6,)" in msgs[f"weight {sbp}"][1]
    kind, text = msgs["float_target"]
    assert kind == "DtypeMismatchError" and "float64" in text, text
    assert "logits of shape (4, 5) with sbp (S(0),)" in text and "target of shape (4,)" in text
