"""`sf.parallel.relayout`, the one parameter re-layout routine of `sf.parallel.apply` and
`sf.auto.parallelize`: a model built without storage (`sf.nn.init.meta_init`) and laid out by
name holds the values of the ordinary build, each rank allocating only its shard, and computes
the loss of its torch twin on one device."""

import contextlib

import pytest
import torch

import sbpflow as sf
from sbpflow.models import gpt_class, layout

F64 = torch.float64
GPT = dict(vocab=16, d=8, heads=2, layers=1, seq=4, batch=4)


def _gpt(nn, F):
    return gpt_class(nn, F)(GPT["vocab"], GPT["d"], GPT["heads"], GPT["layers"], GPT["seq"])


def _data():
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(0, GPT["vocab"], (GPT["batch"], GPT["seq"] + 1), generator=g)
    return tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()


def _laid_out(name, meta, data):
    """The GPT built (under meta_init if ``meta``) and laid out by ``layout(name)``: its
    parameters' layouts, logical values and shard shapes, and the loss on ``data``."""
    sf.manual_seed(0)
    with sf.nn.init.meta_init() if meta else contextlib.nullcontext():
        m = _gpt(sf.nn, sf.nn.functional).double()
    lay = layout("gpt", name, sf.world_size())
    sf.parallel.apply(m, lay.placement, lay.rules, zero=lay.zero)
    params = {n: (p.placement is lay.placement, p.sbp, tuple(p.local.shape), p.local.is_meta)
              for n, p in m.named_parameters()}
    tok, pos, tgt = data
    loss = m(sf.tensor(tok, lay.placement, lay.data_sbp),
             sf.tensor(pos, lay.placement, (sf.B,) * lay.placement.ndim),
             sf.tensor(tgt, lay.placement, lay.data_sbp))
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
    return dict(params=params, sd=m.state_dict(), loss=loss.item(), grads=grads)


@pytest.mark.parametrize("name", ["tp", "2d", "zero"])
def test_apply_materialises_a_meta_model_in_its_layouts(name):
    data = _data()
    meta = sf.launch(_laid_out, 4, args=(name, True, data))
    real = sf.launch(_laid_out, 4, args=(name, False, data))
    twin = _gpt(torch.nn, torch.nn.functional).double()
    twin.load_state_dict(real[0]["sd"])
    loss = twin(*data)
    loss.backward()
    for rank, (a, b) in enumerate(zip(meta, real)):
        # same layout, same shard shapes, storage allocated, the placement object given
        assert a["params"] == b["params"], rank
        assert all(given and not is_meta for given, _, _, is_meta in a["params"].values())
        for k, v in b["sd"].items():
            assert torch.equal(a["sd"][k], v), (rank, k)
        assert a["loss"] == pytest.approx(loss.item(), rel=1e-12)
        for n, p in twin.named_parameters():
            torch.testing.assert_close(a["grads"][n], p.grad, rtol=1e-10, atol=1e-12)
    # the tp layout splits the qkv weight: a rank holds a quarter of its rows, not the whole
    if name == "tp":
        _, sbp, shard, _ = meta[0]["params"]["blocks.0.attn.qkv.weight"]
        assert sbp == (sf.S(0),) and shard == (3 * GPT["d"] // 4, GPT["d"])


def test_relayout_by_function_and_its_errors():
    """Layouts from any function of (name, parameter), meta parameters materialised; a bad
    layout names the routine, the parameter, its shape and the layout."""
    def body():
        pl = sf.placement("cpu", [0, 1])
        sf.manual_seed(0)
        with sf.nn.init.meta_init():
            m = sf.nn.Sequential(sf.nn.Linear(4, 6, dtype=F64), sf.nn.Linear(6, 6, dtype=F64))
        sf.parallel.relayout(m, lambda n, p: (pl, sf.S(0) if n.endswith("weight") else sf.B))
        got = {n: (p.sbp, p.local.is_meta, p.is_leaf, p.requires_grad)
               for n, p in m.named_parameters()}
        with pytest.raises(sf.errors.SplitAxisError) as bad:
            sf.parallel.relayout(m, lambda n, p: (pl, sf.S(1)), "mine")
        return got, str(bad.value)

    got, bad = sf.launch(body, world_size=2)[0]
    assert got == {"0.weight": ((sf.S(0),), False, True, True),
                   "0.bias": ((sf.B,), False, True, True),
                   "1.weight": ((sf.S(0),), False, True, True),
                   "1.bias": ((sf.B,), False, True, True)}
    assert bad.startswith("mine: parameter '0.bias' of shape (6,)") and "S(1)" in bad
