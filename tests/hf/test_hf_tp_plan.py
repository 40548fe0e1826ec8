"""Tensor parallelism by a transformers model's own plan (issue 36, part 3):
`sf.parallel.hf_tp_plan` turns ``model.tp_plan`` (GPT2, OPT, BERT: sbpflow's built-in plans)
into rules of module-aware styles; the seven families of `hf_zoo` train 2 steps on a 1-D mesh
of 4 (tensor parallel) and a 2 x 2 mesh (data x tensor) equal to torch on one device. Float64
models, but HF's causal-LM loss upcasts the logits to float32 and, split by vocabulary, its
log-sum-exp is summed in another order, so the causal LMs' losses and weights are compared at
float32 tolerance (BERT's masked-LM loss is float64: float64 tolerance). The bytes a step
moves equal Megatron's formula, derived below (GPT2 and Llama); the wrong-axis warning fires
for a Conv1D weight split as an ``nn.Linear`` would be, and not for the right rule."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import sbpflow as sf
from hf_zoo import build, token_ids, trained
from sbpflow.nn.torch_layouts import CostlyLayoutWarning

FAMILIES = ["llama", "qwen2", "gpt_neox", "phi", "gpt2", "opt", "bert"]  # gpt2, opt, bert: built in
MESHES = {"tp4": [0, 1, 2, 3], "dp2xtp2": [[0, 1], [2, 3]]}
TOL = dict(rtol=1e-6, atol=1e-7)          # float32 tolerance: the causal LMs' loss is float32
F64_TOL = dict(rtol=1e-10, atol=1e-13)     # BERT's masked-LM loss is float64
LR = 0.1


def _torch_steps(model, ids, steps=2):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = trained(lambda: model(input_ids=ids, labels=ids).loss, opt, steps)
    return losses, model.state_dict()


def _sf_steps(model, ids, ranks, steps=2, zero=0):
    pl = sf.placement("cpu", ranks)
    dp = pl.ndim == 2
    m = sf.parallel.apply(model, pl, sf.parallel.hf_tp_plan(model, dp_dim=0 if dp else None),
                          zero=zero)
    opt = sf.optim.SGD(m.parameters(), lr=LR)
    x = sf.tensor(ids, pl, (sf.S(0), sf.B) if dp else sf.B)
    losses = trained(lambda: m(input_ids=x, labels=x).loss, opt, steps)
    layouts = {n: p.sbp for n, p in m.named_parameters()}
    return losses, m.state_dict(), layouts, sf.comm.stats()


# every family on both meshes; and ZeRO-3 along the plan's B dims (dp and tp) once
CASES = [(n, m) for n in FAMILIES for m in MESHES] + [("llama", "dp2xtp2-zero3")]


@pytest.mark.parametrize("name,mesh", CASES)
def test_tp_by_the_models_plan_trains_as_torch(name, mesh):
    model, ids = build(name), token_ids()
    want_losses, want = _torch_steps(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CostlyLayoutWarning)  # GPT2's fused c_attn (see below)
        losses, got, layouts, stats = sf.launch(
            _sf_steps, world_size=4, args=(model, ids, MESHES[mesh.removesuffix("-zero3")]),
            kwargs=dict(zero=3 if mesh.endswith("zero3") else 0))[0]
    tol = F64_TOL if name == "bert" else TOL
    assert losses == pytest.approx(want_losses, rel=tol["rtol"])
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol)
    split = [n for n, nd in layouts.items() if any(s.is_split for s in nd)]
    assert len(split) >= 4 * model.config.num_hidden_layers, split   # the projections are
    assert stats.kinds.get("fallback") is None, stats   # no op ran replicated


def test_plan_layouts_follow_each_modules_weight_orientation():
    gpt2, llama = build("gpt2"), build("llama")
    mesh = sf.placement("cpu", [[0, 1], [2, 3]])
    S, B = sf.S, sf.B
    got = {}
    for model in (gpt2, llama):
        rules = sf.parallel.hf_tp_plan(model, dp_dim=0)
        names = [n for n, _ in model.named_parameters()]
        got.update(sf.parallel.match_rules(names, rules, mesh, model))
    want = {"transformer.h.0.attn.c_attn.weight": (B, S(1)),   # Conv1D (in, out): colwise
            "transformer.h.0.attn.c_attn.bias": (B, S(0)),
            "transformer.h.0.mlp.c_proj.weight": (B, S(0)),    # rowwise
            "transformer.h.0.mlp.c_proj.bias": (B, B),
            "transformer.wte.weight": (B, S(0)),               # vocabulary-parallel
            "transformer.wpe.weight": (B, B),
            "model.layers.1.self_attn.k_proj.weight": (B, S(0)),   # Linear (out, in)
            "model.layers.1.self_attn.o_proj.weight": (B, S(1)),
            "model.embed_tokens.weight": (B, S(0)), "lm_head.weight": (B, S(0)),
            "model.norm.weight": (B, B)}
    assert {k: got[k] for k in want} == want
    with pytest.raises(sf.SbpError, match="declares no tensor-parallel plan"):
        sf.parallel.hf_tp_plan(torch.nn.Linear(2, 2))
    with pytest.raises(sf.SbpError, match="no other dim is left to split"):
        sf.parallel.match_rules(names, sf.parallel.hf_tp_plan(llama, dp_dim=0),
                                sf.placement("cpu", [0, 1]), llama)   # 1-D: all of it is dp
    with pytest.raises(sf.SbpError, match="moe_tp_experts"):
        sf.parallel.hf_tp_plan(llama, plan={"model.layers.*.mlp": "moe_tp_experts"})


def megatron_bytes(cfg: dict, t: int, itemsize: int) -> int:
    """Bytes rank 0 sends in one training step of Megatron-LM's tensor parallelism on ``t``
    ranks, in sbpflow's accounting (a ring all-reduce of n items sends 2 (t-1)/t n; an
    all-gather or reduce-scatter (t-1)/t n; an all-to-all (t-1)/t^2 n of the whole tensor).
    Activations a = b s h. Per layer: forward, the partial outputs of the two row-parallel
    projections (attention out, MLP down) are reduced; backward, the gradients of the inputs
    of the column-parallel ones (q/k/v, MLP up): 4 all-reduces of a. Plus the
    vocabulary-parallel embedding's forward reduce and the lm_head's input gradient: 2 of a.
    sbpflow runs each as a reduce-scatter + all-gather (the same bytes) with the norms between
    on split tokens, as Megatron's sequence parallelism does, so the gradients of the weights
    replicated over tp (norms, row biases, positions) are all-reduced at the step (R items).
    The vocabulary-parallel cross-entropy reduces b s float32 maxima and sums of exponentials
    (Megatron also the target logits: sbpflow folds them into the loss's partial sum). GPT2's
    c_attn holds [q | k | v] (Megatron: per head), so cutting it moves q, k, v (3a) to
    token-split attention and back (a) by all-to-all, each way, in every layer."""
    b, s, h, layers = cfg["b"], cfg["s"], cfg["h"], cfg["layers"]
    a = b * s * h
    ring = 2 * (t - 1) / t
    total = (4 * layers + 2) * ring * a * itemsize          # activations, fwd + bwd
    total += cfg["replicated"] * ring * itemsize              # gradients of replicated weights
    total += 2 * ring * b * s * 4                             # cross-entropy (float32)
    if cfg["fused_qkv"]:
        total += layers * 2 * (t - 1) / t ** 2 * (3 * a + a) * itemsize
    return round(total)


def _one_step_bytes(model, ids, t):
    pl = sf.placement("cpu", list(range(t)))
    m = sf.parallel.apply(model, pl, sf.parallel.hf_tp_plan(model))
    opt = sf.optim.SGD(m.parameters(), lr=LR)
    x = sf.tensor(ids, pl, sf.B)
    replicated = sum(p.numel() for p in m.parameters() if all(s == sf.B for s in p.sbp))
    sf.comm.reset_stats()
    loss = m(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    sent = sf.comm.stats().sent
    return sent, replicated, sf.comm.stats()


@pytest.mark.parametrize("name,t", [("gpt2", 2), ("gpt2", 4), ("llama", 2), ("llama", 4)])
def test_bytes_per_step_equal_megatrons_formula(name, t):
    # float32 throughout (Llama's RMSNorm computes in float32: in float64 its partial sums
    # would be reduced in float32, fewer bytes than Megatron's float64 all-reduce)
    over = dict(num_key_value_heads=4) if (name, t) == ("llama", 4) else {}
    model, ids = build(name, dtype=torch.float32, **over), token_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CostlyLayoutWarning)
        sent, replicated, stats = sf.launch(_one_step_bytes, world_size=t,
                                            args=(model, ids, t))[0]
    c = model.config
    cfg = dict(b=ids.shape[0], s=ids.shape[1], h=c.hidden_size, layers=c.num_hidden_layers,
               replicated=replicated, fused_qkv=name == "gpt2")
    assert sent == megatron_bytes(cfg, t, 4), stats


def _apply_rules(model, rules):
    pl = sf.placement("cpu", [0, 1])
    sf.parallel.apply(model, pl, rules)


def _costly(model, rules):
    with warnings.catch_warnings(record=True) as caught:   # rank threads warn in this process
        warnings.simplefilter("always")
        sf.launch(_apply_rules, world_size=2, args=(model, rules))
    return [str(w.message) for w in caught if issubclass(w.category, CostlyLayoutWarning)]


def test_a_conv1d_weight_split_as_a_linear_warns_naming_the_cheaper_rule():
    model = build("gpt2")
    linear_axes = {"*.c_fc.weight": sf.S(0), "*.c_fc.bias": sf.S(0), "*": sf.B}  # (out, in)?
    msgs = _costly(model, linear_axes)
    assert len(msgs) == 2, msgs    # one a layer, on the first rank only
    assert "transformer.h.0.mlp.c_fc.weight (HF Conv1D, stored (in, out): (16, 64))" in msgs[0]
    assert "sf.parallel.colwise (here weight (S(1),)" in msgs[0]
    assert _costly(model, {"*.c_fc.*": sf.parallel.colwise, "*": sf.B}) == []
    assert _costly(model, {"*.c_fc.weight": sf.S(1), "*.c_fc.bias": sf.S(0), "*": sf.B}) == []


def _first_forward(model, ids):
    pl = sf.placement("cpu", [0, 1])
    m = sf.parallel.apply(model, pl, sf.parallel.hf_tp_plan(model))
    x = sf.tensor(ids, pl, sf.B)
    m(input_ids=x, labels=x)


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox"])
def test_the_fused_split_warning_fires_for_q_k_v_blocks_not_for_per_head_rows(name):
    # GPT2's c_attn is [q | k | v]: column-split, split(n_embd) cuts across ranks; GPT-NeoX's
    # query_key_value is per head [q_h | k_h | v_h], cut after a reshape by heads: free
    model = build(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")   # as a user sees them: a message once
        sf.launch(_first_forward, world_size=2, args=(model, token_ids()))
    msgs = [str(w.message) for w in caught if issubclass(w.category, CostlyLayoutWarning)]
    if name == "gpt2":
        assert len(msgs) == 1 and msgs[0].startswith(
            "sf.parallel.apply: transformer.h.*.attn.c_attn.weight is laid out (S(1),)"), msgs
        assert "a rule 'transformer.h.*.attn.c_attn.*': (B,)" in msgs[0]
    else:
        assert msgs == []


def _pipeline_tp_steps(model, ids, steps=2):
    stages = [sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])]
    rules = sf.parallel.hf_tp_plan(model)     # the styles resolve on each stage's mesh
    m = sf.parallel.pipeline(sf.nn.from_torch(model, stages[0]), stages,
                             split=["transformer.h.1"], rules=[rules, rules])
    opt = sf.optim.SGD(m.parameters(), lr=LR)
    x = sf.tensor(ids, stages[0], sf.B)
    losses = trained(lambda: m(input_ids=x, labels=x).loss, opt, steps)
    layouts = (m.transformer.h[1].mlp.c_fc.weight.sbp, m.transformer.wte.weight.sbp)
    return losses, m.state_dict(), layouts


def test_the_plan_lays_out_each_pipeline_stage():
    # GPT2 on 2 stages x tp 2: stage 1's Conv1D split by its own axes, and the embedding tied
    # to the lm_head of the last stage laid out alike in both (the plan names both names)
    model, ids = build("gpt2"), token_ids()
    want_losses, want = _torch_steps(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CostlyLayoutWarning)
        losses, got, layouts = sf.launch(_pipeline_tp_steps, world_size=4,
                                         args=(model, ids))[0]
    assert layouts == ((sf.S(1),), (sf.B, sf.S(0)))   # the tie: on both stages' ranks, 2 x 2
    assert losses == pytest.approx(want_losses, rel=TOL["rtol"])
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)


def _generate(model, ids, ranks):
    pl = sf.placement("cpu", ranks)
    m = sf.parallel.apply(model, pl, sf.parallel.hf_tp_plan(model, dp_dim=0))
    out = m.generate(input_ids=sf.tensor(ids, pl, (sf.S(0), sf.B)), max_new_tokens=4,
                     do_sample=False)       # greedy, with the KV cache (its default)
    return out.full_tensor()


def test_greedy_generate_by_the_plan_gives_torchs_tokens():
    model, ids = build("llama"), token_ids()[:, :4]       # GQA, KV cache split by heads
    want = copy.deepcopy(model).generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CostlyLayoutWarning)
        got = sf.launch(_generate, world_size=4, args=(model, ids, MESHES["dp2xtp2"]))[0]
    assert torch.equal(got, want)
