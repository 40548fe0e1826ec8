"""Models written in plain torch, converted by ``sf.nn.from_torch`` and laid out by
``sf.parallel.apply`` or ``sf.auto.parallelize``, trained against the same torch model on one
device (float64): a GPT with separate q / k / v projections and tied embeddings, the
nanoGPT-style GPT of examples/torch_gpt_model.py (fused ``c_attn``, optional LayerNorm bias),
and a ResNet with BatchNorm and in-place residual adds. Data parallel, 2-D data x tensor
parallel and searched: losses, weights, running statistics and state dicts equal torch's; names
and tied weights are torch's. A model each rank builds with its own values trains on the first
rank's (threads and gloo)."""

import copy
import importlib.util
import pathlib
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sbpflow as sf
from sbpflow.nn.torch_layouts import CostlyLayoutWarning, watch_fused_splits

F64 = torch.float64
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _example_model():
    """examples/torch_gpt_model.py, imported (once) as ``torch_gpt_model``."""
    if "torch_gpt_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("torch_gpt_model",
                                                      ROOT / "examples" / "torch_gpt_model.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["torch_gpt_model"] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules["torch_gpt_model"]


# -- a GPT in plain torch: separate q / k / v, tied embeddings ----------------------------------
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TiedGPT(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 4, layers: int = 2,
                 seq: int = 8) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _tokens(vocab: int = 32, batch: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=g), \
        torch.randint(0, vocab, (batch, seq), generator=g)


def _torch_run(model, step, steps: int = 3):
    """Losses of ``steps`` AdamW steps of a copy of ``model`` and its state dict after them."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = step(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _sf_train(m, step, mesh, data_sbp, steps: int = 3):
    """Losses of ``steps`` sf.optim.AdamW steps of the sbpflow model ``m``, its state dict."""
    opt = sf.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = step(m, mesh, data_sbp)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, m.state_dict()


def _sf_run(model, step, mesh_ranks, rules, data_sbp, steps: int = 3):
    """The same on sbpflow ranks: convert, lay out by ``rules``, train with sf.optim.AdamW;
    ``rules`` = AUTO: `sf.auto.parallelize` on the torch model (``data_sbp``: the example
    inputs), then ``plan.model`` on the plan's placement."""
    mesh = sf.placement("cpu", mesh_ranks)
    if rules is AUTO:
        plan = sf.auto.parallelize(model, tuple(sf.tensor(t, mesh, sf.B) for t in data_sbp),
                                   mesh)
        return _sf_train(plan.model, step, plan.placement, (sf.B,) * plan.placement.ndim,
                         steps)
    return _sf_train(sf.parallel.apply(sf.nn.from_torch(model), mesh, rules), step, mesh,
                     data_sbp, steps)


def _same(got, want) -> None:
    (l1, sd1), (l2, sd2) = got, want
    assert l1 == pytest.approx(l2, rel=1e-10, abs=1e-12)
    assert list(sd1) == list(sd2)
    for k in sd2:
        torch.testing.assert_close(sd1[k], sd2[k], rtol=1e-9, atol=1e-11, msg=k)


AUTO = "auto"   # _sf_run's rules: sf.auto.parallelize chooses them
DP = ([0, 1, 2, 3], {"*": sf.B}, sf.S(0))
GPT_2D = ([[0, 1], [2, 3]],
          {"*.attn.[qkv].*": (sf.B, sf.S(0)), "*.attn.proj.weight": (sf.B, sf.S(1)),
           "*.mlp.0.*": (sf.B, sf.S(0)), "*.mlp.2.weight": (sf.B, sf.S(1)), "*": (sf.B, sf.B)},
          (sf.S(0), sf.B))
NANO_2D = ([[0, 1], [2, 3]],
           {"*.mlp.c_fc.*": (sf.B, sf.S(0)), "*.mlp.c_proj.weight": (sf.B, sf.S(1)),
            "*": (sf.B, sf.B)}, (sf.S(0), sf.B))


@pytest.mark.parametrize("layout", [DP, GPT_2D], ids=["dp", "dp-x-tp"])
def test_tied_gpt_with_separate_qkv_trains_as_torch(layout):
    torch.manual_seed(0)
    model = TiedGPT().to(F64)
    x, y = _tokens()
    want = _torch_run(model, lambda m: m(x, y))

    def step(m, mesh, sbp):
        return m(sf.tensor(x, mesh, sbp), sf.tensor(y, mesh, sbp))
    got = sf.launch(_sf_run, world_size=4, args=(model, step, *layout))[0]
    _same(got, want)


@pytest.mark.parametrize("layout", [DP, NANO_2D], ids=["dp", "dp-x-tp"])
def test_nanogpt_style_model_trains_as_torch(layout):
    mod = _example_model()
    torch.manual_seed(0)
    model = mod.GPT(mod.GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=4,
                                  n_embd=16)).to(F64)
    x, y = _tokens()
    want = _torch_run(model, lambda m: m(x, y)[1])

    def step(m, mesh, sbp):
        return m(sf.tensor(x, mesh, sbp), sf.tensor(y, mesh, sbp))[1]
    got = sf.launch(_sf_run, world_size=4, args=(model, step, *layout))[0]
    _same(got, want)


def test_converted_model_keeps_torch_names_ties_checkpoints_and_methods():
    mod = _example_model()
    torch.manual_seed(0)
    model = mod.GPT(mod.GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2,
                                  n_embd=8, bias=False)).to(F64)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    x, _ = _tokens()
    want_logits, _ = model(x)

    def body():
        pl = sf.placement("cpu", [0, 1])
        m = sf.parallel.apply(sf.nn.from_torch(model), pl, {"*.c_fc.*": sf.S(0), "*": sf.B})
        names = [n for n, _ in m.named_parameters()]
        tied = m.transformer.wte.weight is m.lm_head.weight
        kinds = (isinstance(m, mod.GPT), isinstance(m, sf.nn.Module),
                 isinstance(m.lm_head, nn.Linear), isinstance(m.lm_head, sf.nn.Linear))
        logits, loss = m(sf.tensor(x, pl, sf.S(0)))          # generation: x[:, [-1], :]
        m.load_state_dict(other.state_dict())                   # a torch checkpoint
        loaded = m.state_dict()
        try:
            torch.optim.AdamW(m.parameters())
            refusal = None
        except TypeError as exc:
            refusal = str(exc)
        return (names, tied, kinds, m.num_params(), logits.full_tensor(), loss, loaded,
                refusal, m.to(F64) is m)
    (names, tied, kinds, count, logits, loss, loaded, refusal,
     same) = sf.launch(body, world_size=2)[0]
    assert names == [n for n, _ in model.named_parameters()] and tied and all(kinds) and same
    assert count == model.num_params() == sum(p.numel() for p in model.parameters())
    assert loss is None
    torch.testing.assert_close(logits, want_logits)
    assert list(loaded) == list(other.state_dict())
    for k, v in other.state_dict().items():
        torch.testing.assert_close(loaded[k], v, msg=k)
    assert refusal is not None and "sf.optim.AdamW" in refusal
    assert not isinstance(model, sf.nn.Module)   # the torch model is left as it was
    assert all(type(p) is nn.Parameter for p in model.parameters())


# -- a ResNet in plain torch: BatchNorm, ReLU(inplace=True), out += identity --------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, 2))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


RESNET_2D = ([[0, 1], [2, 3]], {"*conv*.weight": (sf.B, sf.S(0)),
                                 "*.downsample.0.weight": (sf.B, sf.S(0)), "*": (sf.B, sf.B)},
             (sf.S(0), sf.B))


@pytest.mark.parametrize("how", ["dp", "dp-x-tp", "auto"])
def test_resnet_with_batchnorm_and_in_place_adds_trains_as_torch(how):
    torch.manual_seed(0)
    model = ResNet().to(F64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 8, 8, generator=g, dtype=F64)
    y = torch.randint(0, 5, (8,), generator=g)
    want = _torch_run(model, lambda m: F.cross_entropy(m(x), y), steps=2)
    layout = {"dp": DP, "dp-x-tp": RESNET_2D, "auto": ([0, 1, 2, 3], AUTO, (x,))}[how]

    def step(m, mesh, sbp):
        return F.cross_entropy(m(sf.tensor(x, mesh, sbp)), sf.tensor(y, mesh, sbp))
    got = sf.launch(_sf_run, world_size=4, args=(model, step, *layout, 2))[0]
    _same(got, want)   # the state dicts hold the running statistics too


# -- a model each rank builds itself: the first rank's values, as DDP's module-state sync -------
def _gpt_step(m, mesh, sbp):
    x, y = _tokens()
    return m(sf.tensor(x, mesh, sbp), sf.tensor(y, mesh, sbp))


def _own_copy_run(model, mesh_ranks, rules, data_sbp, steps: int = 3):
    """Each rank trains its own copy of ``model`` with its rank added to every parameter and
    buffer (rank 0's is ``model``): `_sf_run` after converting it; plus the conversion's
    (sent, received, calls) of broadcast bytes and the number of calls of meta exchanges."""
    mine = copy.deepcopy(model)
    with torch.no_grad():
        for t in (*mine.parameters(), *mine.buffers()):
            t.add_(sf.rank())
    sf.comm.reset_stats()
    m = sf.nn.from_torch(mine, sf.placement("cpu", mesh_ranks))
    st = sf.comm.stats()
    sent = (st["broadcast"].sent, st["broadcast"].recv, st["broadcast"].calls, st["meta"].calls)
    return _sf_run(m, _gpt_step, mesh_ranks, rules, data_sbp, steps), sent


@pytest.mark.parametrize("backend", ["threads", "torch"])
def test_a_model_built_on_each_rank_trains_on_the_first_ranks_values(backend):
    torch.manual_seed(0)
    model = TiedGPT().to(F64)
    x, y = _tokens()
    want = _torch_run(model, lambda m: m(x, y))
    layout = GPT_2D if backend == "threads" else ([0, 1], {"*.mlp.0.*": sf.S(0), "*": sf.B},
                                                  sf.S(0))
    n = 4 if backend == "threads" else 2
    res = sf.launch(_own_copy_run, world_size=n, backend=backend, args=(model, *layout))
    for got, _ in res:   # every rank: rank 0's values, split shards included
        _same(got, want)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())   # tied: once
    assert [r[1] for r in res] == [((n - 1) * nbytes, 0, 1, 1)] + [(0, nbytes, 1, 1)] * (n - 1)


def test_ranks_whose_models_differ_in_shape_are_told_so():
    def body():
        model = nn.Linear(4, 4 + sf.rank())
        sf.nn.from_torch(model)
    with pytest.raises(sf.ShapeError, match=r"rank 0's has 2 parameters and buffers of 20 "
                                            r"elements, rank 1's 2 of 25"):
        sf.launch(body, world_size=2)


def test_a_split_fused_projection_cut_by_the_model_warns():
    mod = _example_model()
    torch.manual_seed(0)
    model = mod.GPT(mod.GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=4, n_embd=16))
    x, y = _tokens()

    def body(rules):
        pl = sf.placement("cpu", [0, 1])
        m = sf.parallel.apply(sf.nn.from_torch(model), pl, rules)
        layouts = sf.parallel.match_rules([n for n, _ in m.named_parameters()], rules, pl)
        watched = watch_fused_splits(m, pl, layouts)
        m(sf.tensor(x, pl, sf.B), sf.tensor(y, pl, sf.B))
        return watched
    fused = {"*.c_attn.*": sf.S(0), "*.attn.c_proj.weight": sf.S(1), "*": sf.B}
    mlp = {"*.c_fc.*": sf.S(0), "*.mlp.c_proj.weight": sf.S(1), "*": sf.B}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert sf.launch(body, world_size=2, args=(fused,))[0] == 1
    texts = [str(w.message) for w in got if issubclass(w.category, CostlyLayoutWarning)]
    assert len(texts) == 1 and "transformer.h.*.attn.c_attn.weight" in texts[0]   # one text a stack
    assert "'transformer.h.*.attn.c_attn.*': (B,)" in texts[0]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert sf.launch(body, world_size=2, args=(mlp,))[0] == 1
    assert not [w for w in got if issubclass(w.category, CostlyLayoutWarning)]


def test_nanogpt_example_runs(monkeypatch):
    import runpy
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts examples/ first
    g = runpy.run_path(str(ROOT / "examples" / "nanogpt.py"))
    tiny = ["--steps", "2", "--sample", "2", "--d", "16", "--seq", "8", "--batch", "4"]
    dp, two_d = g["run"](tiny), g["run"](tiny + ["--layout", "2d"])
    assert len(dp) == 2 and dp == pytest.approx(two_d, rel=1e-5)


def test_a_converted_model_runs_in_graph_mode_as_eager():
    mod = _example_model()
    torch.manual_seed(0)
    model = mod.GPT(mod.GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2,
                                  n_embd=16)).to(F64)
    x, y = _tokens()

    def body(graph: bool):
        pl = sf.placement("cpu", [0, 1])
        m = sf.parallel.apply(sf.nn.from_torch(model), pl, {"*": sf.B})
        opt = sf.optim.AdamW(m.parameters(), lr=1e-2)
        xs, ys = sf.tensor(x, pl, sf.S(0)), sf.tensor(y, pl, sf.S(0))
        if not graph:
            return _sf_losses(m, opt, xs, ys)

        class Step(sf.nn.Graph):
            def __init__(self):
                super().__init__()
                self.model = m
                self.add_optimizer(opt)

            def build(self, x, y):   # positions: torch.arange in forward, a graph constant
                loss = self.model(x, y)[1]
                loss.backward()
                return loss
        step = Step()
        return [step(xs, ys).item() for _ in range(3)]
    eager = sf.launch(body, world_size=2, args=(False,))[0]
    assert sf.launch(body, world_size=2, args=(True,))[0] == pytest.approx(eager, rel=1e-12)


def _sf_losses(m, opt, xs, ys, steps: int = 3) -> list:
    out = []
    for _ in range(steps):
        loss = m(xs, ys)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _auto_gpt_run(model):
    """`_sf_run` through `sf.auto.parallelize` on the torch model, plus what the plan did with
    the tied head: (plan.model's head weight is its token embedding's, the graph's ties)."""
    x, y = _tokens()
    pl = sf.placement("cpu", [0, 1, 2, 3])
    plan = sf.auto.parallelize(model, (sf.tensor(x, pl, sf.B), sf.tensor(y, pl, sf.B)), pl)
    m = plan.model
    tied = (m.head.weight is m.tok.weight, plan.graph.ties, isinstance(m, TiedGPT))
    return _sf_train(m, _gpt_step, plan.placement, (sf.B,) * plan.placement.ndim), tied


def test_auto_parallelize_trains_a_tied_torch_gpt_as_torch():
    torch.manual_seed(0)
    model = TiedGPT().to(F64)     # separate q / k / v, tied embeddings, as a torch module
    x, y = _tokens()
    want = _torch_run(model, lambda m: m(x, y))
    got, tied = sf.launch(_auto_gpt_run, world_size=4, args=(model,))[0]
    _same(got, want)
    assert tied == (True, {"head": "tok"}, True)
