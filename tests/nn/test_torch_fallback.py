"""Torch functions with no sbpflow handler (sbpflow/nn/torch_fallback.py): pointwise by torch's
tags (shards stay split), else as their decompositions into ops with rules (nothing gathered;
tests/nn/test_torch_decomposed.py has more), else replicated (gathered, warned once, counted as 'fallback'), else
eager on the whole values; values and gradients equal plain torch's, in two layouts; in-place,
out=, views, random draws, graphs and ranks outside the placement (docs/torch_models.md, 'What
runs')."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf
from sbpflow.nn.torch_fallback import ReplicatedFallbackWarning

F64 = torch.float64
G = torch.Generator().manual_seed(7)
X = torch.randn(8, 6, generator=G, dtype=F64)
Y = torch.rand(8, 6, generator=G, dtype=F64) + 0.5
W = torch.randn(8, 6, generator=G, dtype=F64)  # weights of the loss: every output matters

# name -> (function of x, y; how it runs: "kept": the result stays split where x is, nothing
# gathered; "composite": as its decomposition, nothing gathered; "gathered": replicated)
CALLS = {
    "special.erf": (lambda x, y: torch.special.erf(x), "kept"),
    "atan2": (lambda x, y: torch.atan2(x, y), "kept"),
    "xlogy": (lambda x, y: torch.xlogy(x, y), "kept"),
    "lerp": (lambda x, y: torch.lerp(x, y, 0.3), "kept"),
    "hypot method": (lambda x, y: x.hypot(y), "kept"),
    "softplus": (lambda x, y: F.softplus(x, beta=2.0), "kept"),
    "diff": (lambda x, y: torch.diff(x, dim=0, prepend=torch.zeros(1, 6, dtype=F64)),
             "composite"),
    "renorm": (lambda x, y: torch.renorm(x, 2, 0, 1.0), "gathered"),
    "einsum": (lambda x, y: torch.einsum("ij,ij->ij", x, y), "gathered"),
    "rot90": (lambda x, y: torch.rot90(x, 2, (0, 1)), "gathered"),
    "fliplr": (lambda x, y: torch.fliplr(x), "composite"),  # (flip's own rule)
    "nanmedian": (lambda x, y: torch.nanmedian(x, 1).values, "gathered"),
    # reductions along dim 1 (torch's reduction tag; the dim read from the aten schema)
    "prod": (lambda x, y: torch.prod(y * x, 1), "kept"),
    "logsumexp keepdim": (lambda x, y: torch.logsumexp(x, dim=1, keepdim=True), "kept"),
    "norm": (lambda x, y: torch.linalg.vector_norm(x, dim=-1), "kept"),
}


def _weights(shape) -> torch.Tensor:
    """Fixed weights of a result's loss, for any shape up to W's."""
    return W.reshape(-1)[:torch.Size(shape).numel()].reshape(shape)


def _calls(layout):
    pl = sf.placement("cpu", [0, 1, 2, 3])
    x = sf.tensor(X, pl, layout).requires_grad_()
    y = sf.tensor(Y, pl, sf.S(1))
    out = {}
    for name, (fn, _) in CALLS.items():
        x.grad = None
        sf.comm.reset_stats()
        r = fn(x, y)
        (r * sf.tensor(_weights(r.shape), pl, sf.B)).sum().backward()
        out[name] = (r.sbp, r.full_tensor(), x.grad.full_tensor(), sf.comm.stats()["fallback"])
    return out


@pytest.mark.parametrize("layout", [sf.S(0), sf.B], ids=["S0", "B"])
def test_functions_without_a_handler_equal_torch_in_values_and_gradients(layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        got = sf.launch(_calls, 4, args=(layout,))[0]
    for name, (fn, how) in CALLS.items():
        x = X.clone().requires_grad_()
        want = fn(x, Y)
        (want * _weights(want.shape)).sum().backward()
        sbp, value, grad, fallback = got[name]
        torch.testing.assert_close(value, want.detach(), msg=name)
        torch.testing.assert_close(grad, x.grad, msg=name)
        if how == "kept" and layout == sf.S(0):  # nothing gathered (y: S(1) -> S(0) boxes)
            assert sbp == (sf.S(0),) and fallback.recv == 0, name
        elif how == "composite":
            assert fallback.recv == 0, name
        elif layout == sf.S(0) and name != "einsum":  # einsum also gathers the S(1) input
            assert sbp == (sf.B,), name
            assert fallback.recv == 8 * 6 * 8 * 3 // 4, name  # 3 of the 4 pieces of x


def _warned_once():
    pl = sf.placement("cpu", [0, 1])
    x = sf.tensor(X, pl, sf.S(0))
    for _ in range(3):
        torch.nanmedian(x, 0)
    torch.nanmedian(x.to_global(sbp=sf.B), 0)  # nothing to gather: no warning
    torch.nanmedian(x.to_global(sbp=sf.S(1)), 0)  # another layout: one more
    return sf.comm.stats()["fallback"].recv


def test_a_gathering_call_warns_once_per_function_and_layout_with_its_bytes():
    with pytest.warns(ReplicatedFallbackWarning) as record:
        recv = sf.launch(_warned_once, 2)
    texts = [str(w.message) for w in record if issubclass(w.category, ReplicatedFallbackWarning)
             and "torch.nanmedian" in str(w.message)]
    assert len(texts) == 2
    assert "(8, 6) (S(0),)" in texts[0] and "384 bytes a call, summed over the ranks" in texts[0]
    assert "'fallback' in sf.comm.stats()" in texts[0] and "(8, 6) (S(1),)" in texts[1]
    # each rank receives the other half of x (24 float64) once for the three calls (boxed once
    # for every consumer while x is unchanged), then the other half of the S(1) copy
    assert recv == [2 * 24 * 8, 2 * 24 * 8]


def _eager_routes():
    pl = sf.placement("cpu", [0, 1, 2, 3])
    x = sf.tensor(X, pl, sf.S(0))
    return {"nonzero": torch.nonzero(x > 0).full_tensor(),
            "unique": torch.unique((x * 2).round()).full_tensor(),
            "equal": torch.equal(x, x), "allclose": torch.allclose(x, x + 1),
            "tolist": (x[:2, :2]).tolist(), "masked_select": torch.masked_select(x, x > 1)
            .full_tensor()}


def test_data_dependent_and_non_tensor_results_run_on_the_whole_value():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        got = sf.launch(_eager_routes, 4)
    assert all(g["equal"] is True and g["allclose"] is False for g in got)
    assert torch.equal(got[2]["nonzero"], torch.nonzero(X > 0))
    assert torch.equal(got[1]["unique"], torch.unique((X * 2).round()))
    assert got[3]["tolist"] == X[:2, :2].tolist()
    assert torch.equal(got[0]["masked_select"], torch.masked_select(X, X > 1))


def _in_place_and_out():
    pl = sf.placement("cpu", [0, 1, 2, 3])
    x = sf.tensor(Y, pl, sf.S(0))
    x.lgamma_()
    out = sf.zeros(8, 6, placement=pl, sbp=sf.S(1), dtype=F64)
    r = torch.cumsum(x, 1, out=out)
    return x.sbp, x.full_tensor(), r is out, out.sbp, out.full_tensor()


def test_in_place_and_out_write_into_the_tensors_own_layout():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        sbp, x, same, out_sbp, out = sf.launch(_in_place_and_out, 4)[0]
    assert sbp == (sf.S(0),) and out_sbp == (sf.S(1),) and same
    torch.testing.assert_close(x, torch.lgamma(Y))
    torch.testing.assert_close(out, torch.cumsum(torch.lgamma(Y), 1))


def _a_view():
    pl = sf.placement("cpu", [0, 1])
    x = sf.tensor(X, pl, sf.S(0))
    d = torch.diagonal(x)
    before = d.full_tensor()
    x.mul_(2)  # a view reads its base's value
    after = d.full_tensor()
    try:
        d.zero_()
        refused = ""
    except sf.errors.UnsupportedTorchFunction as exc:
        refused = str(exc)
    return before, after, refused, x.full_tensor()


def test_a_view_in_torch_reads_its_input_and_refuses_writes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        before, after, refused, x = sf.launch(_a_view, 2)[0]
    torch.testing.assert_close(before, torch.diagonal(X))
    torch.testing.assert_close(after, torch.diagonal(2 * X))
    assert "torch.diagonal returns a view in torch" in refused and "write into the input" in refused
    torch.testing.assert_close(x, 2 * X)  # unchanged by the refused write


def _random_draws(layout):
    sf.manual_seed(3)
    x = sf.tensor(Y / 2, sf.placement("cpu", [0, 1, 2, 3]), layout)
    return torch.bernoulli(x).full_tensor()


def test_a_random_function_draws_the_same_values_in_every_layout_and_rank():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        split = sf.launch(_random_draws, 4, args=(sf.S(0),))
        whole = sf.launch(_random_draws, 4, args=(sf.B,))
    assert all(torch.equal(s, split[0]) for s in split + whole)
    assert set(split[0].unique().tolist()) == {0.0, 1.0}


class _Step(sf.nn.Graph):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def build(self, x):
        return self.fn(x)


def _in_a_graph():
    pl = sf.placement("cpu", [0, 1])
    x = sf.tensor(X, pl, sf.S(0))
    step = _Step(lambda t: torch.cumsum(torch.special.erf(t), 0) * 2)
    first, second = step(x).full_tensor(), step(x * 3).full_tensor()
    try:
        _Step(lambda t: torch.nonzero(t))(x)
        refused = ""
    except sf.SbpError as exc:
        refused = str(exc)
    return first, second, refused


def test_a_graph_records_and_replays_them_and_refuses_data_dependent_shapes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        first, second, refused = sf.launch(_in_a_graph, 2)[0]
    torch.testing.assert_close(first, torch.cumsum(torch.special.erf(X), 0) * 2)
    torch.testing.assert_close(second, torch.cumsum(torch.special.erf(X * 3), 0) * 2)
    assert "torch.nonzero cannot be part of a graph" in refused


def _outside_the_placement():
    pl = sf.placement("cpu", [0, 1])
    x = sf.tensor(X, pl, sf.S(0)).requires_grad_()
    r = torch.cumsum(torch.special.erf(x), 1)
    r.sum().backward()
    return r.local.shape, r.full_tensor() if sf.rank() in pl else None, \
        x.grad.full_tensor() if sf.rank() in pl else None


def test_ranks_outside_the_placement_follow_with_empty_shards():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        got = sf.launch(_outside_the_placement, 4)
    x = X.clone().requires_grad_()
    want = torch.cumsum(torch.special.erf(x), 1)
    want.sum().backward()
    assert [g[0].numel() for g in got[2:]] == [0, 0]
    torch.testing.assert_close(got[0][1], want.detach())
    torch.testing.assert_close(got[1][2], x.grad)


def _small_fixes():
    pl = sf.placement("cpu", [0, 1])
    x = sf.tensor(X[:6, :6] + 1j * Y[:6, :6], pl, sf.S(0))
    r = sf.tensor(X, pl, sf.S(0)).requires_grad_()
    y = r * 2
    y.zero_()  # in the graph: its earlier value gets a zero gradient, as torch's
    (y + r).sum().backward()
    out = {"H": x.H.full_tensor(), "mH": x.mH.full_tensor(), "is_sparse": x.is_sparse,
           "zero_grad": (y.requires_grad, r.grad.full_tensor()),
           "to_copy": r.to("cpu", F64, False, True) is not r, "to_same": r.to("cpu", F64) is r,
           "double": r.double(memory_format=torch.preserve_format) is r,
           "safe_softmax": torch.ops.aten._safe_softmax.default(r, 1).full_tensor()}
    mean = sf.zeros(6, placement=pl, sbp=sf.S(0), dtype=F64)  # written by the function
    var = sf.ones(6, placement=pl, sbp=sf.B, dtype=F64)
    with torch.no_grad():
        norm = torch._native_batch_norm_legit(r, None, None, mean, var, True, 0.1, 1e-5)
    out["writer"] = (norm[0].full_tensor(), mean.sbp, mean.full_tensor(), var.full_tensor())
    for name, fn in {"as_strided": lambda: r.as_strided((2, 2), (1, 1))}.items():
        try:
            fn()
            out[name] = ""
        except sf.errors.UnsupportedTorchFunction as exc:
            out[name] = str(exc)
    return out


def test_properties_flags_and_aten_ops_run_as_torch_writes_included_and_as_strided_is_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        got = sf.launch(_small_fixes, 2)[0]
    c = X[:6, :6] + 1j * Y[:6, :6]
    torch.testing.assert_close(got["H"], c.H)
    torch.testing.assert_close(got["mH"], c.mH)
    assert got["is_sparse"] is False
    assert got["zero_grad"][0] is True and torch.equal(got["zero_grad"][1], torch.ones(8, 6, dtype=F64))
    assert got["to_copy"] and got["to_same"] and got["double"]
    torch.testing.assert_close(got["safe_softmax"], torch.ops.aten._safe_softmax.default(X, 1))
    mean, var = torch.zeros(6, dtype=F64), torch.ones(6, dtype=F64)
    norm = torch._native_batch_norm_legit(X, None, None, mean, var, True, 0.1, 1e-5)
    got_norm, mean_sbp, got_mean, got_var = got["writer"]  # the running stats written back
    torch.testing.assert_close(got_norm, norm[0])
    assert mean_sbp == (sf.S(0),)
    torch.testing.assert_close(got_mean, mean)
    torch.testing.assert_close(got_var, var)
    assert "memory layout" in got["as_strided"]


def _arguments_a_handler_does_not_implement():
    pl = sf.placement("cpu", [0, 1])
    logits = sf.tensor(X, pl, sf.S(0)).requires_grad_()
    probs = sf.tensor(torch.softmax(Y, 1), pl, sf.S(0))
    loss = F.cross_entropy(logits, probs)  # class probabilities: sbpflow's handler has none
    loss.backward()
    start = sf.tensor(torch.tensor(2), pl, sf.B)
    return loss.full_tensor(), logits.grad.full_tensor(), logits.narrow(1, start, 3).full_tensor()


def test_arguments_a_handler_does_not_implement_run_by_the_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        loss, grad, narrowed = sf.launch(_arguments_a_handler_does_not_implement, 2)[0]
    x = X.clone().requires_grad_()
    want = F.cross_entropy(x, torch.softmax(Y, 1))
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(grad, x.grad)
    torch.testing.assert_close(narrowed, X.narrow(1, torch.tensor(2), 3))


def _along_a_dim():
    x = sf.tensor(X, sf.placement("cpu", [0, 1]), sf.S(0)).requires_grad_()  # (rot90 has a
    # decomposition for values only: under autograd it runs replicated)
    torch.nanmedian(x[:, :4], dim=1)  # (nanmedian of x: warned in another test)
    torch.rot90(x, 1, (0, 1))


def test_the_warning_names_the_rule_that_would_make_a_call_cheap():
    with pytest.warns(ReplicatedFallbackWarning) as record:
        sf.launch(_along_a_dim, 2)
    texts = {w.message.args[0].split(" ")[0]: str(w.message) for w in record
             if issubclass(w.category, ReplicatedFallbackWarning)}
    assert "it works along dim [1], so a rule that keeps a split of any other axis" in \
        texts["torch.nanmedian"]
    assert "register a rule for it" in texts["torch.rot90"], texts
