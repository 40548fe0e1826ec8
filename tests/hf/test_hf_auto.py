"""`sf.auto.parallelize` on Hugging Face models (issue 36, part 4): each family of `hf_zoo`
(GPT2, Llama and Qwen2 with grouped-query attention, GPT-NeoX, Phi, OPT, BERT), with its
defaults (SDPA, ``use_cache``, transformers' masking utilities), is traced on shapes (no
fallback to the real forward: ``.to(x.device)``, ``.item()`` on sizes, the cache and the masks
run), searched with the default search on 4 rank threads (1-D; Llama also given a 2x2 mesh;
GPT2 and Llama also in 2 pipeline stages) and trains 2 AdamW steps with HF's own ``labels=``
loss and a padding mask equal to torch on one device. Float64 models; the causal LMs' loss is
float32 (HF's ``ForCausalLMLoss`` upcasts the logits) and Llama / Qwen2 (RMSNorm), GPT-NeoX and
Phi (rotary) compute parts in float32: those compare at float32 tolerance (a float32 rounding
of a vanishing gradient moves AdamW's step, so weights too); GPT2 / OPT logits and all of BERT
at float64's. A forward reading a value of the weights is traced by the real forward
(``meta="auto"``); the arguments errors suggest exist."""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch

import sbpflow as sf
from hf_zoo import CAUSAL, ZOO, build, token_ids, trained

STEPS = 2
F32_INSIDE = {"llama", "qwen2", "gpt_neox", "phi"}   # float32 norms / rotary inside the model
F32 = dict(rtol=1.3e-6, atol=1e-5)                   # torch.testing's float32 tolerance
F64 = dict(rtol=1e-9, atol=1e-12)


def _inputs() -> dict:
    """Token ids and a padding mask (row 0 left-padded by 3): the masking utilities build a
    causal-and-padding mask with rows that attend to nothing."""
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids)


def _torch_train(model, batch: dict) -> dict:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    logits = model(**batch).logits.detach()
    losses = trained(lambda: model(**batch).loss, opt, STEPS)
    return dict(logits=logits, losses=losses, sd=model.state_dict())


def _sf_train(model, batch: dict, ranks, options: dict | None = None) -> dict:
    """`sf.auto.parallelize` of the torch model on its example batch (global tensors split on
    the batch axis; ``options``: its keyword arguments), then the same steps on the plan's
    placement (stage 0's for a pipeline), eagerly."""
    pl = sf.placement("cpu", ranks)
    example = {k: sf.tensor(v, pl, (sf.S(0),) + (sf.B,) * (pl.ndim - 1))
               for k, v in batch.items()}
    plan = sf.auto.parallelize(model, example, pl, **(options or {}))
    m = plan.model
    opt = sf.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    x = {k: plan.input(v) for k, v in batch.items()}
    logits = m(**x).logits.full_tensor()
    sf.comm.reset_stats()
    losses = trained(lambda: m(**x).loss, opt, STEPS)
    return dict(logits=logits, losses=losses, notes=plan.notes, seconds=plan.search_seconds,
                stages=len(plan.stages),
                sd=m.state_dict(),
                layers=[l.name for l in plan.graph.layers], table=plan.strategy.table(),
                fallback=sf.comm.stats()["fallback"].recv)


def _layer_modules(model) -> list:
    """The names of the modules the trace records: Linear, Embedding and HF Conv1D, not a
    subclass with a forward of its own (OPT's positions: it embeds positions it computes
    from the mask; its weight stays replicated)."""
    from transformers.pytorch_utils import Conv1D
    kinds = (torch.nn.Linear, torch.nn.Embedding, Conv1D)
    return [n for n, m in model.named_modules()
            if any(type(m).forward is k.forward for k in kinds)]


def _check(name: str, got: dict, want: dict, model) -> None:
    assert got["notes"] == [] or not any("real forward" in n for n in got["notes"]), got["notes"]
    assert sorted(got["layers"]) == sorted(_layer_modules(model))   # every layer, on shapes
    torch.testing.assert_close(got["logits"], want["logits"],
                               **(F32 if name in F32_INSIDE else F64))
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               **(F32 if name in CAUSAL else F64))
    assert list(got["sd"]) == list(want["sd"])
    tol = F32 if name in CAUSAL else F64
    for k, v in want["sd"].items():
        torch.testing.assert_close(got["sd"][k], v, **tol, msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.parametrize("name", list(ZOO))
def test_parallelize_traces_on_shapes_and_trains_as_torch(name):
    model, batch = build(name), _inputs()
    want = _torch_train(model, batch)
    got = sf.launch(_sf_train, world_size=4, args=(model, batch, [0, 1, 2, 3]))[0]
    print(f"{name}: search {got['seconds']:.2f} s, fallback {got['fallback']} B\n{got['table']}")
    _check(name, got, want, model)


def test_parallelize_on_a_2x2_mesh_trains_as_torch():
    """A 2-D placement: the search's meshes are its ranks reshaped (the strategy is the 1-D
    placement's), the stream on the 2x2 mesh given. Llama (GQA, rotary buffers moved)."""
    name = "llama"
    model, batch = build(name), _inputs()
    want = _torch_train(model, batch)
    got = sf.launch(_sf_train, world_size=4, args=(model, batch, [[0, 1], [2, 3]]))[0]
    _check(name, got, want, model)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_parallelize_with_pipeline_stages_trains_as_torch(name):
    """``stages=2``: the search cuts the chain at a decoder block (GPT2's tied head on the last
    stage gets a copy of the embedding), the steps run eagerly through both stages."""
    model, batch = build(name), _inputs()
    want = _torch_train(model, batch)
    got = sf.launch(_sf_train, world_size=4,
                    args=(model, batch, [0, 1, 2, 3], {"stages": 2}))[0]
    assert got["stages"] == 2
    _check(name, got, want, model)


# -- the trace on shapes, its fallback, and the arguments errors suggest ---------------------------
def _trace_on_shapes(model, batch: dict) -> tuple:
    """`sf.auto.trace` of the converted model (inputs replicated: their values known): the
    layer names, the bytes it sent, and whether every parameter is as it was."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    m = sf.nn.from_torch(model, pl)
    before = {k: v.local for k, v in m.state_dict(keep_vars=True).items()}
    sf.comm.reset_stats()
    graph, _ = sf.auto.trace(m, {k: sf.tensor(v, pl) for k, v in batch.items()})
    sent = sf.comm.stats().sent
    same = all(v.local is before[k] for k, v in m.state_dict(keep_vars=True).items())
    return [l.name for l in graph.layers], sent, same


def test_trace_on_shapes_communicates_nothing_and_leaves_the_model():
    model = build("llama")
    for layers, sent, same in sf.launch(_trace_on_shapes, world_size=4,
                                        args=(model, _inputs())):
        assert sorted(layers) == sorted(_layer_modules(model))
        assert sent == 0 and same


def _trace_layers(model, ids) -> list:
    pl = sf.placement("cpu", [0, 1])
    graph, _ = sf.auto.trace(sf.nn.from_torch(model, pl), {"input_ids": ids, "labels": ids})
    return [l.name for l in graph.layers]


def test_trace_on_shapes_draws_no_dropout_mask(monkeypatch):
    """A model in training mode (GPT2's dropouts): the trace computes no mask on shapes (a
    GPT-2 of 124 M parameters on 8 x 512 tokens drew its masks for 121 s)."""
    from sbpflow.ops import nn_ops

    def drawn(*args, **kwargs):
        raise AssertionError("a dropout mask was drawn on shapes")
    monkeypatch.setattr(nn_ops, "dropout_mask", drawn)
    model = build("gpt2").train()
    layers = sf.launch(_trace_layers, world_size=2, args=(model, token_ids()))[0]
    assert sorted(layers) == sorted(_layer_modules(model))


def _split_ids_refused(model, ids):
    pl = sf.placement("cpu", [0, 1, 2, 3])
    with pytest.raises(sf.errors.TraceError) as info:
        sf.auto.trace(sf.nn.from_torch(model, pl), {"input_ids": sf.tensor(ids, pl, sf.S(0))})
    return str(info.value)


def test_trace_of_split_ids_names_them_and_the_fix():
    """GPT2 reads its ids (``pad_token_id in input_ids``): ids split over the ranks have no
    values in a trace that communicates nothing; the error names them and what to give
    (`parallelize` replicates them itself, as the tests above show)."""
    text = sf.launch(_split_ids_refused, world_size=4, args=(build("gpt2"), token_ids()))[0]
    assert "['input_ids'] are split or partial" in text and "replicated" in text


class _ReadsItsWeights(torch.nn.Module):
    """A forward that branches on a value its weights compute: no trace on shapes runs it."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = self.fc(x)
        h = h.relu() if h.sum().item() > 0 else h.tanh()
        return self.out(h).square().mean()


def _auto_falls_back(model, x, meta):
    pl = sf.placement("cpu", [0, 1, 2, 3])
    plan = sf.auto.parallelize(model, (sf.tensor(x, pl, sf.S(0)),), pl, meta=meta)
    opt = sf.optim.SGD(plan.model.parameters(), lr=0.1)
    losses = trained(lambda: plan.model(plan.input(x)), opt, STEPS)
    return plan.notes, [l.name for l in plan.graph.layers], losses


@pytest.mark.parametrize("meta", ["auto", False])
def test_a_forward_reading_weight_values_is_traced_by_the_real_forward(meta):
    torch.manual_seed(0)
    model = _ReadsItsWeights().double()
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)
    want = trained(lambda: ref(x), torch.optim.SGD(ref.parameters(), lr=0.1), STEPS)
    notes, layers, losses = sf.launch(_auto_falls_back, world_size=4, args=(model, x, meta))[0]
    assert layers == ["fc", "out"]
    assert any("real forward (meta=False)" in n for n in notes) == (meta == "auto")
    assert losses == pytest.approx(want, rel=1e-12)


def _refused_on_shapes(model, x):
    pl = sf.placement("cpu", [0, 1, 2, 3])
    with pytest.raises(sf.errors.TraceError) as info:
        sf.auto.parallelize(model, (sf.tensor(x, pl),), pl, meta=True)
    with pytest.raises(sf.errors.ParallelizeError, match="meta must be"):
        sf.auto.parallelize(model, (sf.tensor(x, pl),), pl, meta="shapes")
    return str(info.value)


_SUGGESTED = re.compile(r"\b(sf(?:\.\w+)+)\(\.\.\., (\w+)=")


def _accepts(qualified: str, argument: str) -> bool:
    """Whether ``sf.a.b`` (resolved from sbpflow) takes a parameter named ``argument``."""
    fn = sf
    for part in qualified.split(".")[1:]:
        fn = getattr(fn, part)
    return argument in inspect.signature(fn).parameters


def test_the_error_on_shapes_suggests_arguments_that_exist():
    model = _ReadsItsWeights().double()
    text = sf.launch(_refused_on_shapes, world_size=4, args=(model, torch.ones(8, 4).double()))[0]
    suggested = _SUGGESTED.findall(text)
    assert ("sf.auto.parallelize", "meta") in suggested and ("sf.auto.trace", "meta") in suggested
    assert all(_accepts(f, a) for f, a in suggested), suggested


def test_every_suggested_sf_argument_in_the_sources_exists():
    """Every ``sf.<function>(..., <argument>=`` an sbpflow message or docstring writes names an
    argument the function takes (``meta=False`` was suggested where `parallelize` took none)."""
    import pathlib
    root = pathlib.Path(sf.__file__).parent
    found = {m for p in root.rglob("*.py") for m in _SUGGESTED.findall(p.read_text())}
    assert ("sf.auto.parallelize", "meta") in found
    wrong = sorted(f"{f}(..., {a}=)" for f, a in found if not _accepts(f, a))
    assert wrong == []


# -- Megatron's roles from the model's own plan ----------------------------------------------------
def _megatron_run(model, batch: dict) -> dict:
    """The traced graph's Megatron baseline (`sf.auto.baselines.megatron`, tp 2 x dp 2) given
    to `parallelize`, trained as `_sf_train` does."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    example = {k: sf.tensor(v, pl) for k, v in batch.items()}
    graph, _ = sf.auto.trace(sf.nn.from_torch(model, pl), example)
    cluster = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=4)
    plan = sf.auto.parallelize(model, example, pl,
                               strategy=sf.auto.baselines.megatron(graph, cluster, tp=2))
    m = plan.model
    opt = sf.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    x = {k: plan.input(v) for k, v in batch.items()}
    logits = m(**x).logits.full_tensor()
    losses = trained(lambda: m(**x).loss, opt, STEPS)
    roles = {l.name: l.attrs["megatron"] for l in graph.layers if l.kind == "linear"}
    return dict(logits=logits, losses=losses, notes=plan.notes, sd=m.state_dict(),
                layers=[l.name for l in plan.graph.layers], roles=roles,
                weights={n: p.sbp for n, p in m.named_parameters()})


def test_megatron_roles_come_from_the_models_plan_and_train_as_torch():
    """Llama declares q / k / v / gate / up colwise and o / down rowwise: the traced roles
    follow (call-order alternation would make k_proj a row layer), so the Megatron baseline
    is Megatron's (a column layer's weight split on its output features)."""
    model, batch = build("llama"), _inputs()
    want = _torch_train(model, batch)
    got = sf.launch(_megatron_run, world_size=4, args=(model, batch))[0]
    col = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
    for layer, role in got["roles"].items():
        assert role == ("col" if layer.endswith(col) else "row"), layer
    assert got["weights"]["model.layers.0.self_attn.k_proj.weight"] == (sf.B, sf.S(0))
    assert got["weights"]["model.layers.0.self_attn.o_proj.weight"] == (sf.B, sf.S(1))
    _check("llama", got, want, model)


# -- the plan's step as a graph --------------------------------------------------------------------
def _graph_train(model, batch: dict) -> dict:
    """``plan.graph_step`` of a 2-stage plan: the step as an ``sf.nn.Graph``, its 4
    micro-batches 1F1B on the actor runtime."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    plan = sf.auto.parallelize(model, {k: sf.tensor(v, pl) for k, v in batch.items()}, pl,
                               stages=2)
    opt = sf.optim.AdamW(plan.model.parameters(), lr=1e-2, weight_decay=0.01)
    step = plan.graph_step(opt, lambda m, ids, mask: m(input_ids=ids, attention_mask=mask,
                                                      labels=ids).loss)
    x = [plan.input(batch[k]) for k in ("input_ids", "attention_mask")]
    losses = [step(*x).item() for _ in range(STEPS)]
    return dict(losses=losses, sd=plan.model.state_dict(), micro_batches=plan.micro_batches)


def test_a_pipelined_plans_graph_step_trains_as_torch():
    model, batch = build("llama"), _inputs()
    want = _torch_train(model, batch)
    got = sf.launch(_graph_train, world_size=4, args=(model, batch))[0]
    assert got["micro_batches"] == 4
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **F32)
    for k, v in want["sd"].items():
        torch.testing.assert_close(got["sd"][k], v, **F32, msg=lambda m: f"{k}: {m}")
