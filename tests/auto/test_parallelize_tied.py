"""Tied weights in automatic parallelism (issue 19, part 4): `sf.auto.trace` marks the second
user of a shared weight (a GPT's LM head using the token embedding's) as ``tied`` with no weight
of its own, so the graph counts the weight once and `evaluate` prices its memory and gradient
sync once; `sf.auto.parallelize` lays the weight out once, in a layout both users accept, and a
GPT with tied embeddings written in plain torch trains on 4 ranks as on one device (float64),
eagerly and as ``plan.graph_step``."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sbpflow as sf
from sbpflow.auto import LayerGraph, Layer
from sbpflow.auto.space import make_layer_strategy

F64 = torch.float64
VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 32, 16, 2, 1, 8, 4


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TiedGPT(nn.Module):
    """GPT-2's layout: the LM head is the token embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList([Block(D, HEADS) for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model():
    torch.manual_seed(0)
    return TiedGPT().to(F64)


def _batches(steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(steps)]


# the distinct weights of the traced layers: wte (= lm_head), wpe, per block qkv, proj, fc, out
WEIGHTS = VOCAB * D + SEQ * D + LAYERS * (D * 3 * D + D * D + 2 * D * 4 * D)


def _trace():
    pl = sf.placement("cpu", [0])
    m = sf.nn.from_torch(_model(), pl)
    x, y = _batches(1)[0]
    return sf.auto.trace(m, (sf.tensor(x, pl, sf.B), sf.tensor(y, pl, sf.B)))[0]


def test_trace_marks_the_tied_head_and_every_count_takes_the_weight_once():
    g = sf.launch(_trace, world_size=1)[0]
    head = g["lm_head"]
    assert head.tied == "wte" and head.weight_shape is None and head.params == 0
    assert g.ties == {"lm_head": "wte"} and head.attrs["megatron"] == "col"
    assert g.params == WEIGHTS
    cluster = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=4)
    dp = sf.auto.baselines.data_parallel(g, cluster)
    bd = sf.auto.evaluate(g, dp, cluster)
    # memory: the weight once (replicated); gradient sync: one all-reduce of each weight
    assert bd.memory["params"] == WEIGHTS * g.itemsize
    untied = LayerGraph([l if l.tied is None else Layer(l.name, l.kind, l.input_shape, (D, VOCAB),
                                                   l.output_shape, l.flops)
                    for l in g.layers], itemsize=g.itemsize)
    ubd = sf.auto.evaluate(untied, sf.auto.baselines.data_parallel(untied, cluster), cluster)
    assert ubd.memory["params"] == (WEIGHTS + D * VOCAB) * g.itemsize
    share = WEIGHTS / (WEIGHTS + D * VOCAB)
    assert bd.grad_sync_bytes == pytest.approx(ubd.grad_sync_bytes * share)
    assert "=wte" in g.summary()


def test_a_graph_refuses_a_tie_to_a_later_or_weightless_layer():
    a = Layer("a", "linear", (4, 8), (8, 8), (4, 8))
    b = Layer("b", "linear", (4, 8), None, (4, 8), tied="a")
    assert LayerGraph([a, b]).params == 64
    with pytest.raises(ValueError, match="not an earlier layer"):
        LayerGraph([Layer("b", "linear", (4, 8), None, (4, 8), tied="a"), a])
    with pytest.raises(ValueError, match="must be None"):
        LayerGraph([a, Layer("b", "linear", (4, 8), (8, 8), (4, 8), tied="a")])


def _mismatched(graph):
    """The embedding vocabulary-split on (4,), the head data parallel on (2, 2): no single
    layout of the shared weight serves both as given."""
    out = {}
    for l in graph.layers:
        if l.name == "wte":
            out[l.name] = make_layer_strategy(l, (4,), ("vocab",))
        elif l.name == "lm_head":
            out[l.name] = make_layer_strategy(l, (2, 2), ("dp", "dp"))
        else:
            out[l.name] = make_layer_strategy(l, (4,), ("dp",))
    return out


def _sf_train(model, how):
    pl = sf.placement("cpu", [0, 1, 2, 3])
    m = sf.nn.from_torch(model, pl)
    batches = _batches()
    example = tuple(sf.tensor(t, pl, sf.B) for t in batches[0])
    strategy = None
    if how == "mismatched":
        strategy = _mismatched(sf.auto.trace(m, example)[0])
    cluster = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=4,
                                     flops_per_device=1e9)
    plan = sf.auto.parallelize(m, example, pl, cluster, strategy=strategy)
    opt = sf.optim.AdamW(m.parameters(), lr=1e-2)
    step = plan.graph_step(opt) if how == "mismatched" else None   # graph mode too
    losses = []
    for x, y in batches:
        if step is not None:
            losses.append(step(plan.input(x), plan.input(y)).item())
            continue
        loss = m(plan.input(x), plan.input(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    w = m.wte.weight
    shared = (m.lm_head.weight is w, sum(p is w for p in m.parameters()),
              sum(p is w for group in opt.param_groups for p in group["params"]))
    st = plan.strategy
    layouts = (st["wte"].mesh, st["lm_head"].mesh, tuple(w.sbp), tuple(w.placement.shape))
    return losses, m.state_dict(), shared, layouts, plan.notes


@pytest.mark.parametrize("how", ["searched", "mismatched"])
def test_parallelize_trains_a_tied_gpt_like_torch(how):
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    want = []
    for x, y in _batches():
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    losses, sd, shared, layouts, notes = sf.launch(_sf_train, world_size=4, args=(model, how))[0]
    assert losses == pytest.approx(want, rel=1e-10)
    assert shared == (True, 1, 1)              # one parameter object, one optimizer entry
    assert list(sd) == list(ref.state_dict())  # both names, as torch's state dict
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-9, atol=1e-11, msg=k)
    wte_mesh, head_mesh, _, w_mesh = layouts
    assert wte_mesh == head_mesh == w_mesh      # both users on the weight's one placement
    if how == "mismatched":   # re-chosen together, and said so
        assert any("lm_head uses the weight of wte" in n for n in notes), notes
