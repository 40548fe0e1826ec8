"""AutoDDL part 4: the 3-D matmul strategy runs and moves the bytes `evaluate` predicts; and
`sf.auto.parallelize` lays the example MLP, GPT and VGG out for a given (Megatron, 3-D, a mesh
per layer) or searched strategy -- also a model built without storage under
`sf.nn.init.meta_init` -- and trains to the losses of the torch twin on one device (float64);
moving between a layer's mesh and the activations' stream mesh costs no bytes of its own."""

import pytest
import torch

import sbpflow as sf
from sbpflow.auto import LayerGraph, Layer, LayerStrategy, evaluate
from sbpflow.models import gpt_class, mlp_class, vgg_class

B, P, S = sf.B, sf.P, sf.S
F64 = torch.float64


# ---- the 3-D matmul on a 2x2x2 mesh -------------------------------------------------------------
THREE_D = LayerStrategy((2, 2, 2), (S(0), B, S(1)), (B, S(1), S(0)), (S(0), S(1), P))
REDUCED = (S(0), S(1), S(0))   # the partial output reduce-scattered


def _three_d(tokens, d_in, d_out):
    pl = sf.placement("cpu", ranks=[[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    g = torch.Generator().manual_seed(0)
    X = torch.randn(tokens, d_in, generator=g, dtype=F64)
    W = torch.randn(d_in, d_out, generator=g, dtype=F64)
    G = torch.randn(tokens, d_out, generator=g, dtype=F64)
    x = sf.tensor(X, pl, THREE_D.input).requires_grad_()
    w = sf.tensor(W, pl, THREE_D.weight).requires_grad_()
    gy = sf.tensor(G, pl, REDUCED)
    sf.comm.reset_stats()
    y = x @ w
    out_sbp = y.sbp
    y = y.to_global(sbp=REDUCED)
    fwd = sf.comm.stats()
    sf.comm.reset_stats()
    y.backward(gy)
    bwd = sf.comm.stats()
    sf.comm.reset_stats()
    wg = w.grad.to_global(sbp=w.sbp)       # weight-gradient sync (what the optimizer does)
    sync = sf.comm.stats()
    return dict(out_sbp=out_sbp, fwd=fwd, bwd=bwd, sync=sync, y=y.full_tensor(),
                gx_sbp=x.grad.sbp, gx=x.grad.full_tensor(), gw_sbp=w.grad.sbp,
                gw=wg.full_tensor(), X=X, W=W, G=G)


@pytest.mark.parametrize("tokens,d_in,d_out", [(8, 12, 8), (6, 10, 6)], ids=["even", "uneven"])
def test_3d_matmul_values_and_bytes_equal_evaluate(tokens, d_in, d_out):
    res = sf.launch(_three_d, 8, args=(tokens, d_in, d_out))
    r = res[0]
    # the layouts are the 3-D family's: no boxing of the inputs, partial output along p3
    assert r["out_sbp"] == THREE_D.output
    assert r["gx_sbp"] == (S(0), P, S(1)) and r["gw_sbp"] == (P, S(1), S(0))
    X, W, G = (r[k].clone().requires_grad_(k != "G") for k in ("X", "W", "G"))
    Y = X @ W
    Y.backward(G)
    for q in res:
        torch.testing.assert_close(q["y"], Y.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(q["gx"], X.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(q["gw"], W.grad, rtol=1e-12, atol=1e-12)
    # measured bytes, summed over the 8 ranks, against the analytic model (per device x 8)
    layer = Layer("fc", "linear", (tokens, d_in), (d_in, d_out), (tokens, d_out))
    cluster = sf.cost.Cluster(2, 4, intra=(1e-6, 1e-10), inter=(1e-5, 1e-9))
    bd = evaluate(LayerGraph([layer], itemsize=8), [THREE_D], cluster)
    fwd = sum(q["fwd"].sent for q in res)
    bwd = sum(q["bwd"].sent for q in res)
    sync = sum(q["sync"].sent for q in res)
    assert {k for q in res for k in q["fwd"].kinds} == {"reduce_scatter"}
    assert {k for q in res for k in q["bwd"].kinds} == {"all_gather"}
    assert {k for q in res for k in q["sync"].kinds} == {"all_reduce"}
    assert fwd == pytest.approx(8 * bd.forward_bytes) and fwd > 0
    assert bwd == pytest.approx(8 * bd.backward_bytes) and bwd > 0
    assert sync == pytest.approx(8 * bd.grad_sync_bytes) and sync > 0
    # by hand (even case): the output piece of a rank is tokens*d_out/4 elements, reduce-scattered
    # over 2 (half of it sent); the weight piece d_in*d_out/4 all-reduced over 2 (all of it sent)
    if (tokens, d_in, d_out) == (8, 12, 8):
        assert fwd == bwd == 8 * (8 * 8 // 4) * 8 // 2
        assert sync == 8 * (12 * 8 // 4) * 8


# ---- parallelize: training equals the torch twin ------------------------------------------------
STEPS = 3
MLP = dict(sizes=(8, 16, 16, 6), batch=8)
GPT = dict(vocab=16, d=8, heads=2, layers=1, seq=4, batch=4)
VGG = dict(channels=(3, 4, 8), image=8, hidden=16, batch=4)


def _build(model, nn, F):
    if model == "mlp":
        return mlp_class(nn, F)(MLP["sizes"])
    if model == "vgg":
        return vgg_class(nn, F)(VGG["channels"], image=VGG["image"], hidden=VGG["hidden"])
    return gpt_class(nn, F)(GPT["vocab"], GPT["d"], GPT["heads"], GPT["layers"], GPT["seq"])


def _inputs(model):
    g = torch.Generator().manual_seed(7)
    if model == "mlp":
        return [torch.randn(MLP["batch"], MLP["sizes"][0], generator=g, dtype=F64),
                torch.randint(0, MLP["sizes"][-1], (MLP["batch"],), generator=g)]
    if model == "vgg":
        return [torch.randn(VGG["batch"], 3, VGG["image"], VGG["image"], generator=g, dtype=F64),
                torch.randint(0, 10, (VGG["batch"],), generator=g)]
    tok = torch.randint(0, GPT["vocab"], (GPT["batch"], GPT["seq"] + 1), generator=g)
    return [tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()]


def tiny_cluster(world=4):
    # slow compute so the search weighs splitting the work against moving bytes
    return sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=world,
                                  flops_per_device=1e9)


def _sf_run(model, how):
    sf.manual_seed(0)
    m = _build(model, sf.nn, sf.nn.functional).double()
    sd0 = m.state_dict()
    if how.startswith("meta-"):   # the same model built without storage: parallelize fills it
        how = how[len("meta-"):]
        sf.manual_seed(0)
        with sf.nn.init.meta_init():
            m = _build(model, sf.nn, sf.nn.functional).double()
    cluster = tiny_cluster(sf.world_size())
    pl = sf.placement("cpu", list(range(sf.world_size())))
    strategy = None
    one_mesh = how.endswith("-one-mesh")
    how = how.replace("-one-mesh", "")
    if how == "megatron":
        from sbpflow.auto.trace import trace
        graph, _ = trace(m, _inputs(model))
        strategy = sf.auto.baselines.megatron(graph, cluster, tp=2)   # (dp 2, tp 2)
    elif how == "mixed":   # layers on different meshes of the 4 ranks
        from sbpflow.auto.trace import trace
        graph, _ = trace(m, _inputs(model))
        strategy = _mixed(graph)
    elif how == "3d":   # every linear the 3-D matmul on a 2x2x2 mesh
        from sbpflow.auto.space import make_layer_strategy
        from sbpflow.auto.trace import trace
        graph, _ = trace(m, _inputs(model))
        strategy = {l.name: make_layer_strategy(l, (2, 2, 2), ("dp", "col", "row"))
                    for l in graph.layers}
    plan = sf.auto.parallelize(m, _inputs(model), pl, cluster, strategy=strategy,
                               one_mesh=one_mesh)
    sbps = {n: p.sbp for n, p in m.named_parameters()}
    meshes = {n: tuple(p.placement.shape) for n, p in m.named_parameters()}
    sd_laid_out = m.state_dict()
    opt = sf.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01)
    losses = []
    for _ in range(STEPS):
        args = [plan.input(v) for v in _inputs(model)]
        opt.zero_grad()
        loss = m(*args)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(sd0=sd0, losses=losses, sd=m.state_dict(), sbps=sbps, strategy=plan.strategy,
                mesh=tuple(plan.placement.shape), meshes=meshes, laid_out=sd_laid_out)


def _torch_run(model, sd0):
    m = _build(model, torch.nn, torch.nn.functional).double()
    m.load_state_dict(sd0)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01, foreach=False)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = m(*_inputs(model))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m.state_dict()


def _close(a, b, what):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64),
                               rtol=1e-6, atol=1e-9, msg=lambda m: f"{what}: {m}")


EXPECTED = {   # what a Megatron (dp 2 x tp 2) strategy must have done to the parameters
    "mlp": {"net.0.weight": (B, S(0)), "net.0.bias": (B, S(0)), "net.2.weight": (B, S(1)),
            "net.2.bias": (B, B), "net.4.weight": (B, S(0))},
    "gpt": {"blocks.0.attn.qkv.weight": (B, S(0)), "blocks.0.attn.proj.weight": (B, S(1)),
            "blocks.0.mlp.fc.bias": (B, S(0)), "tok.weight": (B, S(0)),
            "head.weight": (B, S(0)), "ln_f.weight": (B, B)},
}


CASES = [("mlp", "megatron"), ("mlp", "searched"), ("mlp", "3d"), ("gpt", "megatron"),
         ("gpt", "searched"), ("mlp", "mixed"), ("gpt", "mixed"), ("gpt", "meta-mixed"),
         ("vgg", "mixed"), ("mlp", "mixed-one-mesh"), ("mlp", "searched-one-mesh")]


@pytest.mark.parametrize("model,how", CASES, ids=[f"{m}-{h}" for m, h in CASES])
def test_parallelize_trains_like_one_device(model, how):
    world = 8 if how == "3d" else 4
    r = sf.launch(_sf_run, world, args=(model, how))[0]
    sd0, losses, sd, sbps, strategy, mesh = (r[k] for k in ("sd0", "losses", "sd", "sbps",
                                                           "strategy", "mesh"))
    for k, v in sd0.items():   # laying out (or materialising) keeps the logical values
        assert torch.equal(r["laid_out"][k], v), k
    if how.endswith("one-mesh"):
        assert len({s.mesh for s in strategy.layers}) == 1
        assert set(r["meshes"].values()) == {mesh}
    elif how.endswith("mixed"):
        # each layer's parameters live on its own mesh; activations on their refinement
        assert mesh == (2, 2)
        for layer, (lmesh, _) in MIXED[model].items():
            assert r["meshes"][f"{layer}.weight"] == lmesh, layer
        assert {s.mesh for s in strategy.layers} == {(4,), (2, 2)}
        if model == "mlp":
            assert sbps["net.0.weight"] == (S(0),) and sbps["net.2.weight"] == (B, S(1))
            assert sbps["net.4.weight"] == (S(0), B) and sbps["net.4.bias"] == (S(0), B)
        elif model == "vgg":   # conv weights (out, in, kh, kw) as the graph's; bias follows out
            assert sbps["features.5.weight"] == (S(0), S(1)) and sbps["features.7.bias"] == (B,)
            assert sbps["features.2.bias"] == (B, S(0)) and sbps["classifier.3.weight"] == (S(1),)
        else:
            assert sbps["tok.weight"] == (S(0),) and sbps["blocks.0.attn.proj.weight"] == (S(1),)
            assert sbps["ln_f.weight"] == (B, B) and r["meshes"]["ln_f.weight"] == (2, 2)
    elif how == "3d":
        assert mesh == (2, 2, 2)
        assert sbps["net.2.weight"] == (B, S(0), S(1)) and sbps["net.2.bias"] == (B, S(0), B)
    elif how == "megatron":
        assert mesh == (2, 2)
        for name, nd in EXPECTED[model].items():
            assert sbps[name] == nd, f"{name}: {sbps[name]} != {nd}"
    else:
        # the searched strategy is a real one: not everything replicated
        assert any(s.names and set(s.names) != {"rep"} for s in strategy.layers), strategy
    t_losses, t_sd = _torch_run(model, sd0)
    _close(losses, t_losses, "losses")
    assert losses[-1] < losses[0], losses
    for k, v in t_sd.items():
        _close(sd[k], v, k)


def test_a_strategy_on_several_meshes_moves_to_the_majority_mesh():
    from sbpflow.auto.parallelize import _to_one_mesh
    from sbpflow.auto.space import Strategy, make_layer_strategy
    g = sf.auto.model_graphs.mlp((64, 128, 128, 64), batch=32)
    layers = [make_layer_strategy(g["fc0"], (4,), ("dp",)),
              make_layer_strategy(g["fc1"], (2, 2), ("dp", "col")),
              make_layer_strategy(g["fc2"], (2, 2), ("dp", "row"))]
    notes = []
    s = _to_one_mesh(g, Strategy(g, layers), tiny_cluster(), notes)
    assert [x.mesh for x in s.layers] == [(2, 2)] * 3
    assert s.layers[1:] == layers[1:]
    assert len(notes) == 1 and "fc0" in notes[0] and "(2, 2)" in notes[0]
    same = Strategy(g, [make_layer_strategy(g["fc0"], (2, 2), ("dp", "col"))] + layers[1:])
    notes = []
    assert _to_one_mesh(g, same, tiny_cluster(), notes) is same and notes == []


def test_single_mesh_search_is_the_best_single_mesh_strategy():
    from sbpflow.auto.parallelize import single_mesh_search
    g = sf.auto.model_graphs.mlp((64, 128, 128, 64), batch=32)
    c = tiny_cluster()
    s, bd, cost = single_mesh_search(g, c)
    assert len({x.mesh for x in s.layers}) == 1
    assert cost == pytest.approx(bd.time)
    for tp in (1, 2, 4):   # no Megatron t x d (single-mesh strategies) beats it
        other = sf.auto.baselines.megatron(g, c, tp=tp)
        assert bd.time <= sf.auto.evaluate(g, other, c).time * (1 + 1e-12)


# ---- a mesh per layer -----------------------------------------------------------------------------
MIXED = {   # layer -> (mesh, 1-D signature per mesh dim): consecutive layers change meshes
    "mlp": {"net.0": ((4,), ("col",)), "net.2": ((2, 2), ("dp", "row")),
            "net.4": ((2, 2), ("col", "dp"))},
    "gpt": {"tok": ((4,), ("vocab",)), "pos": ((2, 2), ("dp", "dim")),
            "blocks.0.attn.qkv": ((2, 2), ("dp", "col")), "blocks.0.attn.proj": ((4,), ("row",)),
            "blocks.0.mlp.fc": ((2, 2), ("col", "dp")), "blocks.0.mlp.proj": ((2, 2), ("row", "dp")),
            "head": ((4,), ("dp",))},
    "vgg": {"features.0": ((4,), ("dp",)), "features.2": ((2, 2), ("dp", "outch")),
            "features.5": ((2, 2), ("outch", "inch")), "features.7": ((4,), ("inch",)),
            "classifier.1": ((2, 2), ("dp", "col")), "classifier.3": ((4,), ("row",))},
}


def _mixed(graph):
    from sbpflow.auto.space import make_layer_strategy
    table = next(t for t in MIXED.values() if set(t) == set(graph.index))
    out = {}
    for l in graph.layers:
        mesh, names = table[l.name]
        out[l.name] = make_layer_strategy(l, mesh, names)
        assert out[l.name] is not None, (l, mesh, names)
    return out


CHAIN = [((4,), ("col",)), ((2, 2), ("dp", "row")), ((4,), ("row",)), ((2, 2), ("col", "dp")),
         ((4,), ("dp",))]   # (4,) row's partial output crosses onto (2, 2) unreduced


def _chain_bytes():
    """A chain of linears whose layers alternate meshes (4,) and (2, 2): bytes moved forward
    and backward, and the stream-placement boxings the layer boundaries are planned as."""
    from sbpflow.auto.space import make_layer_strategy
    sf.manual_seed(0)
    m = sf.nn.Sequential(*[sf.nn.Linear(16, 16, bias=False) for _ in CHAIN]).double()
    x0 = torch.randn(8, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    graph, _ = sf.auto.trace(m, (x0,))
    strategy = {l.name: make_layer_strategy(l, *c) for l, c in zip(graph.layers, CHAIN)}
    plan = sf.auto.parallelize(m, (x0,), sf.placement("cpu", [0, 1, 2, 3]), tiny_cluster(),
                               strategy=strategy)
    stream, st = plan.placement, plan.strategy.layers
    image = {(4,): lambda nd: (nd[0], nd[0]), (2, 2): lambda nd: tuple(nd)}
    planned_fwd = planned_bwd = 0
    for a, b in zip(st, st[1:]):   # producer output -> consumer input, both seen on the stream
        src, dst = image[a.mesh](a.output), image[b.mesh](b.input)
        planned_fwd += sf.boxing.plan((8, 16), F64, (stream, src), (stream, dst)).nbytes
        # the same boxing alone, forward and backward, on this rank
        t = sf.randn(8, 16, placement=stream, sbp=src, dtype=F64).requires_grad_()
        u = t.to_global(sbp=dst)
        sf.comm.reset_stats()
        u.backward(sf.ones(8, 16, placement=stream, sbp=sf.sbp.dual_nd(dst), dtype=F64))
        planned_bwd += sf.comm.stats().sent
    x = plan.input(x0, sbp=image[st[0].mesh](st[0].input))
    sf.comm.reset_stats()
    y = m(x)
    fwd = sf.comm.stats().sent
    gy = sf.tensor(torch.ones(8, 16, dtype=F64), stream, sf.sbp.dual_nd(y.sbp))
    sf.comm.reset_stats()
    y.backward(gy)
    bwd = sf.comm.stats().sent
    return fwd, bwd, planned_fwd, planned_bwd, y.sbp, y.full_tensor(), x0, {
        n: p.full_tensor() for n, p in m.named_parameters()}


def test_layer_boundaries_move_only_the_planned_redistribution():
    res = sf.launch(_chain_bytes, 4)
    fwd, bwd = sum(r[0] for r in res), sum(r[1] for r in res)
    planned_fwd, planned_bwd = res[0][2], sum(r[3] for r in res)
    out_sbp, y, x0, params = res[0][4:]
    # moving between a (4,) layer and the (2, 2) stream is a relabel: no bytes of its own, the
    # activation moves (forward) and its gradient (backward) only as the stream boxings do
    assert fwd == planned_fwd > 0 and bwd == planned_bwd > 0
    assert out_sbp == (S(0), S(0))          # the last layer's S(0) on (4,), seen on (2, 2)
    ref = x0
    for i in range(len(CHAIN)):
        ref = ref @ params[f"{i}.weight"].T
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


def test_common_refinement():
    from sbpflow.auto.parallelize import ParallelizeError, common_refinement
    assert common_refinement([(4,), (2, 2)]) == (2, 2)
    assert common_refinement([(2, 4), (4, 2)]) == (2, 2, 2)
    assert common_refinement([(8,), (2, 4), (2, 2, 2)]) == (2, 2, 2)
    assert common_refinement([(4, 3)]) == (4, 3)
    assert common_refinement([(3, 4), (4, 3)]) is None
    with pytest.raises(ParallelizeError):
        common_refinement([(4,), (2, 4)])


SIX = {"net.0": ((2, 3), ("dp", "col")), "net.2": ((3, 2), ("dp", "row")),
       "net.4": ((6,), ("dp",))}


def _six_ranks():
    from sbpflow.auto.space import make_layer_strategy
    sizes, g = (12, 12, 12, 6), torch.Generator().manual_seed(7)
    data = [torch.randn(12, 12, generator=g, dtype=F64), torch.randint(0, 6, (12,), generator=g)]
    sf.manual_seed(0)
    sd0 = mlp_class(sf.nn, sf.nn.functional)(sizes).double().state_dict()
    with sf.nn.init.meta_init():
        m = mlp_class(sf.nn, sf.nn.functional)(sizes).double()
    m.load_state_dict(sd0)   # no storage yet: recorded, applied when parallelize materialises
    graph, _ = sf.auto.trace(m, data)
    strategy = {l.name: make_layer_strategy(l, *SIX[l.name]) for l in graph.layers}
    plan = sf.auto.parallelize(m, data, sf.placement("cpu", list(range(6))), tiny_cluster(6),
                               strategy=strategy)
    opt = sf.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = m(*[plan.input(v) for v in data])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sd0, losses, plan.notes, tuple(plan.placement.shape), data, sizes


def test_meshes_without_a_common_refinement_still_train_like_one_device():
    sd0, losses, notes, stream, data, sizes = sf.launch(_six_ranks, 6)[0]
    # (2, 3) and (3, 2) share no row-major refinement: the stream is the mesh refining most
    assert stream in ((2, 3), (3, 2)) and len(notes) == 1 and "no common refinement" in notes[0]
    t = mlp_class(torch.nn, torch.nn.functional)(sizes).double()
    t.load_state_dict(sd0)
    opt = torch.optim.SGD(t.parameters(), lr=0.1)
    t_losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = t(*data)
        loss.backward()
        opt.step()
        t_losses.append(loss.item())
    _close(losses, t_losses, "losses")
