"""sf.nn modules: torch's registration API and names, layout-independent initialisation, state
dicts to and from torch twins, layers against torch.nn, sf.parallel.apply and its errors."""

import math

import pytest
import torch

import sbpflow as sf
from nn_twin import F64, LAYOUTS, layout, sf_mlp, torch_mlp


# -- a model with nested containers and its torch.nn twin ----------------------------------------
class SfBlock(sf.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = sf.nn.Embedding(11, 8, padding_idx=3, dtype=F64)
        self.ln = sf.nn.LayerNorm(8, dtype=F64)
        self.heads = sf.nn.ModuleList([sf.nn.Linear(8, 6, dtype=F64),
                                       sf.nn.Linear(6, 4, bias=False, dtype=F64)])
        self.out = sf.nn.ModuleDict({"proj": sf.nn.Linear(4, 2, dtype=F64), "act": sf.nn.GELU()})
        self.seq = sf.nn.Sequential(sf.nn.Tanh(), sf.nn.Linear(2, 3, dtype=F64))

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        for m in self.heads:
            h = m(h)
        return self.seq(self.out["act"](self.out["proj"](h)))


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8, padding_idx=3)
        self.ln = torch.nn.LayerNorm(8)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(8, 6), torch.nn.Linear(6, 4, bias=False)])
        self.out = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 2), "act": torch.nn.GELU()})
        self.seq = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(2, 3))

    def forward(self, ids):
        h = self.ln(self.emb(ids))
        for m in self.heads:
            h = m(h)
        return self.seq(self.out["act"](self.out["proj"](h)))


BLOCK_RULES = {"emb.weight": sf.S(1), "heads.0.weight": sf.S(0), "heads.0.bias": sf.S(0),
               "heads.1.weight": sf.S(1), "*": sf.B}


def test_names_shapes_and_state_dicts_line_up_with_torch():
    ids_full = torch.tensor([[1, 3, 5], [10, 0, 3]])

    def body():
        sf.manual_seed(0)
        m = SfBlock()
        names = [(n, tuple(p.shape)) for n, p in m.named_parameters()]
        sd0 = m.state_dict()
        pl = sf.placement("cpu", [0, 1, 2])
        sf.parallel.apply(m, pl, BLOCK_RULES)
        after = [(n, tuple(p.shape)) for n, p in m.named_parameters()]
        sd1 = m.to_torch_state_dict()
        ids = sf.tensor(ids_full, pl, sf.S(0))
        y = m(ids)
        y.backward(sf.ones(*y.shape, placement=pl, sbp=sf.B, dtype=F64))
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        sbps = {n: p.sbp for n, p in m.named_parameters()}
        return names, after, sd0, sd1, y.full_tensor(), grads, sbps

    names, after, sd0, sd1, y, grads, sbps = sf.launch(body, world_size=3)[0]
    tm = TorchBlock().to(F64)
    assert names == after == [(n, tuple(p.shape)) for n, p in tm.named_parameters()]
    assert list(sd0) == list(tm.state_dict())
    assert sbps["emb.weight"] == (sf.S(1),) and sbps["heads.1.weight"] == (sf.S(1),)
    assert sbps["heads.0.bias"] == (sf.S(0),) and sbps["ln.weight"] == (sf.B,)
    for k in sd0:  # the gathered values do not depend on the layout
        assert torch.equal(sd0[k], sd1[k]), k
    assert torch.all(sd0["emb.weight"][3] == 0)  # padding row
    tm.load_state_dict(sd0)
    ref = tm(ids_full)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(y, ref.detach(), rtol=1e-10, atol=1e-12)
    for n, p in tm.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_load_state_dict_from_torch_keeps_each_rank_shard():
    tm = TorchBlock().to(F64)
    sd = tm.state_dict()

    def body():
        m = SfBlock()
        pl = sf.placement("cpu", [[0, 1], [2, 3]])
        sf.parallel.apply(m, pl, {"heads.0.weight": (sf.S(0), sf.S(1)), "emb.weight": (sf.P, sf.B),
                                  "*": (sf.B, sf.S(0))})
        res = m.load_state_dict(sd)
        w = m.heads[0].weight
        # global tensors load too: boxed from m's layouts to other's
        other = SfBlock()
        sf.parallel.apply(other, sf.placement("cpu", [0, 1, 2, 3]), {"*.weight": sf.S(0),
                                                                     "*": sf.B})
        other.load_state_dict(m.state_dict(keep_vars=True))
        return res, m.state_dict(), tuple(w.local.shape), w.sbp, other.state_dict()

    res, got, local_shape, sbp, got_other = sf.launch(body, world_size=4)[0]
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert sbp == (sf.S(0), sf.S(1)) and local_shape == (3, 4)
    for k, v in sd.items():
        assert torch.equal(got[k], v) and torch.equal(got_other[k], v), k


@pytest.mark.parametrize("case", ["B", "S0", "S1", "P", "2d"])
def test_init_gives_the_same_logical_weights_in_every_layout(case):
    sbp, ranks = {"B": (sf.B, [0, 1, 2]), "S0": (sf.S(0), [0, 1, 2]), "S1": (sf.S(1), [0, 1, 2]),
                  "P": (sf.P, [0, 1, 2]), "2d": ((sf.S(1), sf.S(0)), [[0, 1], [2, 3]])}[case]

    def body():
        sf.manual_seed(5)
        pl = sf.placement("cpu", ranks)
        lin = sf.nn.Linear(7, 9, placement=pl, sbp=sbp, dtype=F64)
        conv = sf.nn.Conv2d(3, 5, 3, placement=pl, sbp=sbp, dtype=F64)
        return lin.state_dict(), conv.state_dict(), lin.bias.sbp

    def reference():
        sf.manual_seed(5)
        return (sf.nn.Linear(7, 9, dtype=F64).state_dict(),
                sf.nn.Conv2d(3, 5, 3, dtype=F64).state_dict())

    lin, conv, bias_sbp = sf.launch(body, world_size=4)[0]
    ref_lin, ref_conv = sf.launch(reference, world_size=1)[0]
    for got, ref in ((lin, ref_lin), (conv, ref_conv)):
        for k in ref:
            assert torch.equal(got[k], ref[k]), (case, k)
    # the bias follows the weight's output axis: split with S(0), replicated with S(1)
    want = {"B": (sf.B,), "S0": (sf.S(0),), "S1": (sf.B,), "P": (sf.P,), "2d": (sf.B, sf.S(0))}
    assert bias_sbp == want[case]
    # torch's bounds: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias
    for sd, fan_in in ((lin, 7), (conv, 27)):
        for v in sd.values():
            assert v.abs().max() <= 1 / math.sqrt(fan_in) and v.std() > 0.2 / math.sqrt(fan_in)


def test_init_functions():
    def body():
        pl = sf.placement("cpu", [0, 1, 2])
        out = {}
        for sbp in (sf.S(0), sf.S(1), sf.B, sf.P):
            t = sf.zeros(300, 200, placement=pl, sbp=sbp, dtype=F64)
            res = {}
            sf.nn.init.normal_(t, 1.0, 2.0, seed=3)
            res["normal"] = t.full_tensor().clone()
            sf.nn.init.xavier_uniform_(t, seed=4)
            res["xavier"] = t.full_tensor().clone()
            sf.nn.init.kaiming_uniform_(t, nonlinearity="relu", seed=4)
            res["kaiming"] = t.full_tensor().clone()
            sf.nn.init.ones_(t)
            res["ones"] = t.full_tensor().clone()
            out[repr(sbp)] = res
        return out

    out = sf.launch(body, world_size=3)[0]
    first = next(iter(out.values()))
    for res in out.values():
        for k in res:
            assert torch.equal(res[k], first[k]), k
    n = first["normal"]
    assert abs(float(n.mean()) - 1.0) < 0.05 and abs(float(n.std()) - 2.0) < 0.05
    bound = math.sqrt(6.0 / 500)
    assert first["xavier"].abs().max() <= bound and first["xavier"].abs().max() > 0.95 * bound
    kb = math.sqrt(2.0) * math.sqrt(3.0 / 200)
    assert first["kaiming"].abs().max() <= kb and first["kaiming"].abs().max() > 0.95 * kb
    # same seed and bounds as kaiming: only the scale differs
    torch.testing.assert_close(first["kaiming"] / kb, first["xavier"] / bound)
    assert torch.equal(first["ones"], torch.ones(300, 200, dtype=F64))


def test_cnn_layers_match_torch():
    x_full = torch.randn(4, 3, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(0))

    def make_sf():
        return sf.nn.Sequential(sf.nn.Conv2d(3, 4, 3, padding=1, dtype=F64), sf.nn.ReLU(),
                                sf.nn.MaxPool2d(2), sf.nn.Conv2d(4, 6, 3, stride=1, dtype=F64),
                                sf.nn.AvgPool2d(2), sf.nn.Flatten(), sf.nn.Linear(6, 5, dtype=F64))

    def body():
        sf.manual_seed(1)
        m = make_sf()
        sd = m.state_dict()
        pl = sf.placement("cpu", [0, 1])
        sf.parallel.apply(m, pl, {"0.weight": sf.S(0), "0.bias": sf.S(0), "*": sf.B})
        y = m(sf.tensor(x_full, pl, sf.S(0)))
        (y * y).sum().backward()
        return sd, y.full_tensor(), {n: p.grad.full_tensor() for n, p in m.named_parameters()}

    sd, y, grads = sf.launch(body, world_size=2)[0]
    tm = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                             torch.nn.MaxPool2d(2), torch.nn.Conv2d(4, 6, 3), torch.nn.AvgPool2d(2),
                             torch.nn.Flatten(), torch.nn.Linear(6, 5)).to(F64)
    assert [(n, tuple(v.shape)) for n, v in sd.items()] == \
        [(n, tuple(v.shape)) for n, v in tm.state_dict().items()]
    tm.load_state_dict(sd)
    ref = tm(x_full)
    (ref * ref).sum().backward()
    torch.testing.assert_close(y, ref.detach(), rtol=1e-10, atol=1e-12)
    for n, p in tm.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)


def test_dropout_mask_is_layout_independent_and_eval_is_identity():
    x_full = torch.randn(40, 30, dtype=F64, generator=torch.Generator().manual_seed(0)) + 3.0

    def body(sbp):
        pl = sf.placement("cpu", [0, 1, 2])
        drop = sf.nn.Dropout(0.25)
        x = sf.tensor(x_full, pl, sbp)
        sf.manual_seed(9)
        y_train = drop(x).full_tensor()
        drop.eval()
        y_eval = drop(x).full_tensor()
        return y_train, y_eval, drop.training

    outs = [sf.launch(body, world_size=3, args=(s,))[0] for s in (sf.S(0), sf.S(1), sf.B)]
    y0, e0, training = outs[0]
    assert not training
    for y, e, _ in outs[1:]:
        assert torch.equal(y, y0) and torch.equal(e, e0)
    assert torch.equal(e0, x_full)
    kept = y0 != 0
    assert 0.65 < float(kept.double().mean()) < 0.85
    torch.testing.assert_close(y0[kept], x_full[kept] / 0.75)


def test_module_registration_and_traversal():
    m = sf_mlp(dropout=0.1)
    assert [n for n, _ in m.named_children()] == ["0", "1", "2", "3"]
    assert len(list(m.modules())) == 5 and len(m) == 4
    assert isinstance(m[0], sf.nn.Linear) and isinstance(m[1:], sf.nn.Sequential)
    assert [n for n, _ in m[2:].named_parameters()] == ["3.weight", "3.bias"]  # as torch
    assert all(isinstance(p, sf.nn.Parameter) and p.is_leaf and p.requires_grad
               for p in m.parameters())
    m.eval()
    assert not any(mod.training for mod in m.modules())
    m.train()
    assert all(mod.training for mod in m.modules())
    # assigning a Parameter registers it; a plain global tensor in its slot is refused
    lin = m[0]
    new_w = sf.nn.Parameter(sf.zeros(10, 5, dtype=F64))
    lin.weight = new_w
    assert lin.weight is new_w and dict(lin.named_parameters())["weight"] is new_w
    with pytest.raises(TypeError):
        lin.weight = sf.zeros(10, 5, dtype=F64)
    lin.extra = sf.nn.Parameter(sf.zeros(2, dtype=F64))
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias", "extra"]
    del lin.extra
    assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
    # dtype casts keep names and layouts, and the tensors stay leaves
    as32 = sf_mlp().float()
    assert all(p.dtype == torch.float32 and p.is_leaf and p.requires_grad
               for p in as32.parameters())
    assert [n for n, _ in as32.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # shared modules and parameters are listed once
    shared = sf.nn.Linear(3, 3)
    twice = sf.nn.Sequential(shared, sf.nn.ReLU(), shared)
    assert len(list(twice.parameters())) == 2 and len(list(twice.modules())) == 3
    assert "Linear(in_features=5, out_features=10, bias=True)" in repr(m)
    # zero_grad sets grads to None
    x = sf.randn(2, 5, dtype=F64, seed=0)
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_load_state_dict_errors_name_shapes_placements_and_sbps():
    def body():
        m = sf_mlp()
        pl = sf.placement("cpu", [0, 1])
        sf.parallel.apply(m, pl, {"0.weight": sf.S(1), "*": sf.B})
        sd = torch_mlp().state_dict()
        bad = dict(sd, **{"0.weight": torch.zeros(10, 4, dtype=F64)})
        errors = []
        with pytest.raises(sf.ShapeError) as exc:
            m.load_state_dict(bad)
        errors.append(str(exc.value))
        before = m.state_dict()
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
        missing = {k: v for k, v in sd.items() if k != "2.bias"}
        with pytest.raises(sf.nn.StateDictError) as exc2:
            m.load_state_dict(dict(missing, extra=torch.zeros(1)))
        errors.append(str(exc2.value))
        res = m.load_state_dict(missing, strict=False)
        return errors, res, isinstance(exc2.value, sf.SbpError)

    errors, res, is_sbp_error = sf.launch(body, world_size=2)[0]
    assert "0.weight" in errors[0] and "(10, 4)" in errors[0] and "(10, 5)" in errors[0]
    assert "cpu[0,1]" in errors[0] and "S(1)" in errors[0]
    assert is_sbp_error and "2.bias" in errors[1] and "extra" in errors[1]
    assert res.missing_keys == ["2.bias"] and res.unexpected_keys == []


def test_parallel_apply_rules_and_errors():
    def body():
        pl = sf.placement("cpu", [0, 1])
        m = sf_mlp()
        with pytest.raises(sf.SbpError) as unmatched:
            sf.parallel.apply(m, pl, {"0.*": sf.S(0), "2.weight": sf.B})
        with pytest.raises(sf.errors.SplitAxisError) as bad_axis:
            sf.parallel.apply(m, pl, {"*.bias": sf.S(1), "*": sf.B})
        with pytest.raises(sf.SbpError):
            sf.parallel.apply(m, pl, {"*": "Q(0)"})
        with pytest.raises(sf.errors.SbpParseError) as length:  # one sbp per mesh dim of ``pl``
            sf.parallel.apply(m, pl, {"*": (sf.S(0), sf.B)})
        # first matching pattern wins
        sf.parallel.apply(m, pl, {"0.weight": sf.S(1), "0.*": sf.S(0), "*": sf.B})
        got = {n: p.sbp for n, p in m.named_parameters()}
        leaves = all(p.is_leaf and p.requires_grad and isinstance(p, sf.nn.Parameter)
                     for p in m.parameters())
        # tied parameters stay tied
        tied = sf.nn.Sequential(sf.nn.Linear(4, 4, dtype=F64), sf.nn.Linear(4, 4, dtype=F64))
        tied[1].weight = tied[0].weight
        sf.parallel.apply(tied, pl, {"*": sf.S(0)})
        return (str(unmatched.value), type(unmatched.value).__name__, str(bad_axis.value), got,
                leaves, tied[1].weight is tied[0].weight, tied[0].weight.sbp, str(length.value))

    unmatched, kind, bad_axis, got, leaves, still_tied, tied_sbp, length = \
        sf.launch(body, world_size=2)[0]
    assert "rule '*' on cpu[0,1]" in length and "(S(0), B)" in length, length
    assert kind == "UnmatchedParameterError" and "'2.bias'" in unmatched
    assert "'0.weight'" not in unmatched and "'0.bias'" not in unmatched
    assert "'0.bias'" in bad_axis and "(10,)" in bad_axis and "S(1)" in bad_axis
    assert "cpu[0,1]" in bad_axis
    assert got == {"0.weight": (sf.S(1),), "0.bias": (sf.S(0),), "2.weight": (sf.B,),
                   "2.bias": (sf.B,)}
    assert leaves and still_tied and tied_sbp == (sf.S(0),)


def test_layouts_used_by_training_tests_place_parameters_as_named():
    def body(name):
        sf.manual_seed(0)
        m = sf_mlp()
        pl, _, rules = layout(name)
        sf.parallel.apply(m, pl, rules)
        return {n: (p.sbp, tuple(p.local.shape)) for n, p in m.named_parameters()}

    tp = sf.launch(body, world_size=4, args=("tp",))[0]
    assert tp["0.weight"] == ((sf.S(0),), (3, 5)) and tp["2.weight"] == ((sf.S(1),), (3, 3))
    zero = sf.launch(body, world_size=4, args=("zero",))
    assert [z["2.bias"][1] for z in zero] == [(1,), (1,), (1,), (0,)]  # uneven: one empty shard
    assert set(LAYOUTS) == {"dp", "tp", "hybrid", "zero", "replicated"}


def test_an_optimizer_built_before_module_to_refuses_to_step():
    """Module.to makes new parameter objects (torch keeps them): an optimizer built before
    would step tensors nothing uses, silently; it raises naming the parameter and the fix."""
    pl = sf.placement("cpu", [0])
    m = sf.nn.Sequential(sf.nn.Linear(3, 3))
    early = sf.optim.SGD(m.parameters(), lr=0.1)
    m.double()
    late = sf.optim.SGD(m.parameters(), lr=0.1)
    x = sf.tensor(torch.ones(2, 3, dtype=torch.float64), pl, (sf.B,))
    m(x).sum().backward()
    w0 = m[0].weight.full_tensor().clone()
    late.step()
    assert not torch.equal(m[0].weight.full_tensor(), w0)
    with pytest.raises(sf.SbpError, match=r"parameter '0\.weight' .*Module\.to replaced it.*"
                                          r"Build the optimizer after Module\.to"):
        early.step()
