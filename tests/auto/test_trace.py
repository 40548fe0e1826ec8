"""AutoDDL part 2: `sf.auto.trace` runs the forward on shapes only (meta tensors): the graph
equals the one of a real forward, no weight is allocated or touched and nothing is
communicated; `sf.nn.init.meta_init` builds a model without storage whose materialised
parameters equal an ordinary build's."""

import pytest
import torch

import sbpflow as sf
from sbpflow.auto.trace import TraceError, trace
from sbpflow.models import gpt_class, mlp_class, vgg_class

F64 = torch.float64


def _model_and_inputs(kind):
    g = torch.Generator().manual_seed(3)
    nn, F = sf.nn, sf.nn.functional
    if kind == "mlp":
        return (mlp_class(nn, F)((8, 16, 16, 6)).double(),
                [torch.randn(8, 8, generator=g, dtype=F64), torch.randint(0, 6, (8,), generator=g)])
    if kind == "gpt":
        tok = torch.randint(0, 16, (4, 5), generator=g)
        return (gpt_class(nn, F)(16, 8, 2, 2, 4).double(),
                [tok[:, :-1].contiguous(), torch.arange(4), tok[:, 1:].contiguous()])
    return (vgg_class(nn, F)((3, 4, 8), image=8, hidden=16).double(),
            [torch.randn(2, 3, 8, 8, generator=g, dtype=F64), torch.randint(0, 10, (2,), generator=g)])


def _layers(graph):
    return [(l.name, l.kind, tuple(l.input_shape), l.weight_shape and tuple(l.weight_shape),
             tuple(l.output_shape), l.flops, l.accepts_partial, dict(l.attrs))
            for l in graph.layers]


def _trace_both(kind, meta_build):
    sf.manual_seed(0)
    ref, inputs = _model_and_inputs(kind)
    real, _ = trace(ref, inputs, meta=False)
    sf.manual_seed(0)
    if meta_build:
        with sf.nn.init.meta_init():
            m, _ = _model_and_inputs(kind)
    else:
        m = ref
    before = [(id(p), p.local.clone() if not p.local.is_meta else None, p.placement, p.sbp)
              for p in m.parameters()]
    sf.comm.reset_stats()
    graph, modules = trace(m, inputs)
    stats = sf.comm.stats()
    after = list(m.parameters())
    same = all(id(p) == i and p.placement == pl and p.sbp == nd and
               (p.local.is_meta if v is None else torch.equal(p.local, v))
               for p, (i, v, pl, nd) in zip(after, before))
    return dict(meta=_layers(graph), real=_layers(real), sent=stats.sent, recv=stats.recv,
                kinds=dict(stats.kinds), same=same and len(after) == len(before),
                all_meta=all(p.local.is_meta for p in after),
                modules={n: type(mod).__name__ for n, mod in modules.items()})


KINDS = {"mlp": {"linear"}, "gpt": {"embedding", "linear"}, "vgg": {"conv", "linear"}}


@pytest.mark.parametrize("meta_build", [False, True], ids=["built", "meta-built"])
@pytest.mark.parametrize("kind", ["mlp", "gpt", "vgg"])
def test_meta_trace_equals_the_real_trace_and_touches_nothing(kind, meta_build):
    for r in sf.launch(_trace_both, 2, args=(kind, meta_build)):
        assert r["meta"] == r["real"]
        assert {l[1] for l in r["meta"]} == KINDS[kind]
        assert r["sent"] == r["recv"] == 0 and not r["kinds"], r["kinds"]
        assert r["same"]                         # the very parameters, values and layouts back
        assert r["all_meta"] == meta_build       # a meta-built model stays without storage


def test_traced_layers_by_hand():
    r = sf.launch(_trace_both, 1, args=("vgg", False))[0]
    conv0 = r["meta"][0]
    assert conv0[:5] == ("features.0", "conv", (2, 3, 8, 8), (4, 3, 3, 3), (2, 4, 8, 8))
    assert conv0[5] == 2.0 * 2 * 4 * 3 * 3 * 3 * 8 * 8 and conv0[7] == {"megatron": "outch"}
    assert [l[0] for l in r["meta"]] == ["features.0", "features.2", "features.5",
                                         "features.7", "classifier.1", "classifier.3"]
    fc = r["meta"][4]     # after two 2x2 poolings: 8 channels of 2x2
    assert fc[1:5] == ("linear", (2, 32), (32, 16), (2, 16))
    g = sf.launch(_trace_both, 1, args=("gpt", False))[0]["meta"]
    # tokens = batch * seq; a linear's weight is (in, out); Megatron roles alternate col / row
    assert g[0][:5] == ("tok", "embedding", (16,), (16, 8), (16, 8))
    assert g[2][:5] == ("blocks.0.attn.qkv", "linear", (16, 8), (8, 24), (16, 24))
    assert [l[7]["megatron"] for l in g[2:6]] == ["col", "row", "col", "row"]


def test_trace_outside_launch_is_single_rank_and_local():
    sf.manual_seed(0)
    m, inputs = _model_and_inputs("mlp")
    graph, modules = trace(m, inputs)
    assert [l.name for l in graph.layers] == ["net.0", "net.2", "net.4"]
    assert graph.itemsize == 8 and modules["net.2"] is m.net[2]


def test_a_forward_that_needs_values_names_the_way_out():
    class NeedsValues(sf.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = sf.nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y * y.sum().item()     # data-dependent: no value on meta tensors

    m = NeedsValues()
    with pytest.raises(TraceError, match="meta=False") as info:
        trace(m, (torch.ones(2, 4),))
    assert isinstance(info.value, sf.SbpError)
    assert [l.name for l in trace(m, (torch.ones(2, 4),), meta=False)[0].layers] == ["fc"]


def _meta_build(layout):
    sf.manual_seed(0)
    ref, _ = _model_and_inputs("gpt")
    want = ref.state_dict()
    sf.manual_seed(0)
    sf.comm.reset_stats()
    with sf.nn.init.meta_init():
        m, _ = _model_and_inputs("gpt")
    built = sf.comm.stats()
    metas = [p.local.device.type == "meta" for p in m.parameters()]   # no storage
    dtypes = {p.dtype for p in m.parameters()}
    if layout == "own":
        sf.nn.init.materialize_(m)
        got = m.state_dict()
    else:   # straight into a split layout: each rank fills only its shard
        pl = sf.placement("cpu", list(range(sf.world_size())))
        got = {}
        for n, p in m.named_parameters():
            t = sf.nn.init.materialize(p, pl, sf.S(0))
            got[n] = (t.full_tensor(), tuple(t.local.shape))
        got = {n: v for n, (v, _) in got.items()}
    return want, got, metas, dtypes, built.sent, [p.local.is_meta for p in m.parameters()]


@pytest.mark.parametrize("layout", ["own", "split"])
def test_meta_init_materialises_the_ordinary_values(layout):
    for want, got, metas, dtypes, sent, still_meta in sf.launch(_meta_build, 2, args=(layout,)):
        assert all(metas) and dtypes == {F64} and sent == 0
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k     # exactly: the same seeds and fills
        assert not any(still_meta) if layout == "own" else all(still_meta)
