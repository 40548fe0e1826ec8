"""``model.generate()`` of transformers' causal LMs on sbpflow (issue 36, part 2): each causal
family of `hf_zoo`, converted by `sf.parallel.apply` and called unmodified with a global tensor of
token ids and the default KV cache, gives torch's tokens exactly: greedy (with an end-of-sequence
id that stops some rows early: their padding) and beam search, on 4 ranks with the weights
replicated and the ids split on the batch or replicated, and with Megatron rules written by hand
on Llama's attention and MLP (tensor parallel on 2 ranks); a left-padded batch with its
``attention_mask``; incremental decoding (``past_key_values``) gives torch's logits. The result is
a global tensor: with the weights replicated, in the ids' layout.

Sampling (``do_sample=True``) gives the same tokens on every layout, and gathers nothing: each
``torch.multinomial`` draw takes its seed from sbpflow's stream (``sf.manual_seed(s)`` on every
rank: draw k is seeded ``s_k = mix_seed(s, k)``) and draws each row of the probabilities on the
rank that holds it, row r with ``torch.multinomial(probs[r], n, generator=torch.Generator()
.manual_seed(mix_seed(s_k, r)))``. So it equals torch's ``generate`` with its draws made that way
(the reference below) -- not torch's run after one ``torch.manual_seed(s)``, whose draws continue
one generator over the whole batch (torch's own seed is not used)."""

from __future__ import annotations

import warnings

import pytest
import torch

import sbpflow as sf
from hf_zoo import CAUSAL, build, token_ids
from sbpflow.nn.torch_fallback import ReplicatedFallbackWarning
from sbpflow.random_regions import mix_seed

PROMPT = token_ids(4, 5)
NEW = 3
WORLD = 4
PAD = 2
# Megatron's rules for Llama, tensor parallel on 2 ranks (each holds 2 of the 4 query heads and
# 1 of the 2 key / value heads): nn.Linear weights are (out, in), so the column-parallel q / k /
# v / gate / up projections split axis 0, the row-parallel o / down projections axis 1
MEGATRON = {
    **{f"*.{n}.weight": sf.S(0) for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")},
    **{f"*.{n}.weight": sf.S(1) for n in ("o_proj", "down_proj")},
    "*": sf.B,
}
TP = 2


def _generate(model, ids, **kw):
    return model.generate(input_ids=ids, max_new_tokens=NEW, pad_token_id=PAD, **kw)


def _searches(model) -> dict:
    """The searches run on every layout, by name: greedy with row 0's first new token as the
    end-of-sequence id (row 0 stops at once and is padded), beam search with 2 and 3 beams."""
    stop = int(_generate(model, PROMPT, do_sample=False)[0, PROMPT.shape[1]])
    return {"greedy": dict(do_sample=False), "greedy_eos": dict(do_sample=False, eos_token_id=stop),
            "beam2": dict(num_beams=2, do_sample=False), "beam3": dict(num_beams=3, do_sample=False)}


def _on_layouts(model, searches: dict, layouts: dict, world: int = WORLD) -> dict:
    """(search, layout) -> (tokens, type, sbp) of sbpflow's generate on ``world`` rank threads;
    a layout is (rules, the ids' sbp, the names of the searches it runs)."""
    def body():
        out = {}
        for lname, (rules, ids_sbp, names) in layouts.items():
            pl = _flat(world)
            m = sf.parallel.apply(model, pl, rules)
            for sname in names:
                got = _generate(m, sf.tensor(PROMPT, pl, ids_sbp), **searches[sname])
                out[sname, lname] = (got.full_tensor(), type(got), got.sbp)
        return out
    with warnings.catch_warnings():   # beam search writes the prompt into a torch.full buffer
        warnings.filterwarnings("ignore", "Tensor.__setitem__ writes global tensors",
                                ReplicatedFallbackWarning)
        return sf.launch(body, world_size=world)[0]


def _flat(world: int = WORLD):
    return sf.placement("cpu", list(range(world)))


@pytest.mark.parametrize("family", CAUSAL)
def test_greedy_and_beam_search_give_torch_tokens(family):
    model = build(family)
    searches = _searches(model)
    want = {name: _generate(model, PROMPT, **kw) for name, kw in searches.items()}
    layouts = {"ids_S0": ({"*": sf.B}, sf.S(0), ("greedy_eos", "beam2")),
               "ids_B": ({"*": sf.B}, sf.B, ("greedy", "beam3"))}
    got = _on_layouts(model, searches, layouts)
    for (sname, lname), (tokens, kind, sbp) in got.items():
        assert torch.equal(tokens, want[sname]), (family, sname, lname, tokens, want[sname])
        assert kind is sf.GlobalTensor and sbp == (layouts[lname][1],), (sname, lname, sbp)
    assert (want["greedy_eos"][0, PROMPT.shape[1]:] == PAD).sum() == NEW - 1   # row 0 padded


def test_megatron_tensor_parallel_llama_gives_torch_tokens():
    model = build("llama")
    searches = _searches(model)
    want = {name: _generate(model, PROMPT, **searches[name]) for name in ("greedy_eos", "beam3")}
    got = _on_layouts(model, searches, {"tp": (MEGATRON, sf.B, ("greedy_eos", "beam3"))}, TP)
    for (sname, _), (tokens, kind, sbp) in got.items():
        assert torch.equal(tokens, want[sname]), (sname, tokens, want[sname])
        assert kind is sf.GlobalTensor, kind   # (its layout sbpflow's choice: S(0) today)


@pytest.mark.parametrize("zero", [0, 3])
def test_greedy_gathers_nothing_and_warns_nothing(zero):
    """Greedy decoding without a padding mask runs no replicated fallback: no "fallback" bytes
    and no `ReplicatedFallbackWarning` (what does gather is named in the other tests); also with
    the weights sharded by ZeRO-3 (gathered layer by layer, as in training)."""
    model = build("llama")

    def body():
        pl = _flat()
        m = sf.parallel.apply(model, pl, {"*": sf.B}, zero=zero)
        sf.comm.reset_stats()
        tokens = _generate(m, sf.tensor(PROMPT, pl, sf.S(0)), do_sample=False).full_tensor()
        return tokens, sf.comm.stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, stats = sf.launch(body, world_size=WORLD)[0]
    assert torch.equal(tokens, _generate(model, PROMPT, do_sample=False))
    assert not [w for w in caught if issubclass(w.category, ReplicatedFallbackWarning)]
    assert "fallback" not in str(stats), stats


def _reseeded_torch_sampling(model, seed: int, **kw) -> torch.Tensor:
    """torch's generate with draw k of torch.multinomial made row by row, row r under a
    torch.Generator seeded mix_seed(mix_seed(seed, k), r): what sbpflow draws after
    sf.manual_seed(seed)."""
    draw, calls = torch.multinomial, []

    def by_rows(probs, num_samples, replacement=False):
        step = mix_seed(seed, len(calls))
        calls.append(1)
        rows = [draw(row, num_samples, replacement,
                     generator=torch.Generator().manual_seed(mix_seed(step, r)))
                for r, row in enumerate(probs.reshape(-1, probs.shape[-1]))]
        return torch.stack(rows).reshape(*probs.shape[:-1], num_samples)
    torch.multinomial = by_rows
    try:
        return _generate(model, PROMPT, do_sample=True, **kw)
    finally:
        torch.multinomial = draw


def _sampled(model, layouts: dict, seeds, world: int, **kw) -> dict:
    """(layout, seed) -> the tokens sbpflow samples after sf.manual_seed(seed)."""
    def body():
        out = {}
        for lname, (rules, ids_sbp) in layouts.items():
            pl = _flat(world)
            m = sf.parallel.apply(model, pl, rules)
            for seed in seeds:
                sf.manual_seed(seed)
                out[lname, seed] = _generate(m, sf.tensor(PROMPT, pl, ids_sbp), do_sample=True,
                                             **kw).full_tensor()
        return out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sf.launch(body, world_size=world)[0]
    assert not [w for w in caught if issubclass(w.category, ReplicatedFallbackWarning)]
    return got


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sampling_is_the_same_on_every_layout(family):
    model = build(family)
    kw = dict(top_k=20, temperature=0.9)
    want = {s: _reseeded_torch_sampling(model, s, **kw) for s in (0, 7)}
    got = _sampled(model, {"ids_S0": ({"*": sf.B}, sf.S(0)), "ids_B": ({"*": sf.B}, sf.B)},
                   want, WORLD, **kw)
    if family == "llama":
        got.update(_sampled(model, {"tp": (MEGATRON, sf.B)}, want, TP, **kw))
    for (lname, seed), tokens in got.items():
        assert torch.equal(tokens, want[seed]), (lname, seed, tokens, want[seed])
    assert not torch.equal(want[0], want[7])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_left_padded_batch_with_attention_mask(family):
    model = build(family)
    mask = torch.ones_like(PROMPT)
    mask[1, :2] = 0
    mask[3, :1] = 0
    want = {n: _generate(model, PROMPT, attention_mask=mask, **kw)
            for n, kw in (("greedy", dict(do_sample=False)),
                          ("beam", dict(num_beams=2, do_sample=False)))}

    def body():
        pl = _flat()
        m = sf.parallel.apply(model, pl, {"*": sf.B})
        ids = sf.tensor(PROMPT, pl, sf.S(0))
        sf.comm.reset_stats()
        greedy = _generate(m, ids, attention_mask=sf.tensor(mask, pl, sf.S(0)), do_sample=False)
        gathered = "fallback" in str(sf.comm.stats())   # the mask's rows: picked in order
        # beam search repeats the mask per beam: a global one (sbpflow's expansion, as
        # transformers' of a torch tensor) and a plain one (transformers', then lifted)
        beam = _generate(m, ids, attention_mask=sf.tensor(mask, pl, sf.S(0)), num_beams=2,
                         do_sample=False)
        plain = _generate(m, ids, attention_mask=mask, num_beams=2, do_sample=False)
        return {"greedy": greedy.full_tensor(), "beam": beam.full_tensor(),
                "beam plain mask": plain.full_tensor()}, gathered
    with warnings.catch_warnings():   # beam search writes the prompt into a torch.full buffer
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        got, gathered = sf.launch(body, world_size=WORLD)[0]
    want["beam plain mask"] = want["beam"]
    for n in want:
        assert torch.equal(got[n], want[n]), (family, n, got[n], want[n])
    assert not gathered


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_incremental_decoding_with_past_key_values_gives_torch_logits(family):
    """Prefill 4 tokens, then 2 steps of one token each given the cache (as ``past_key_values``,
    the name transformers 5 deprecates, then as ``cache``): the logits of every call equal
    torch's (float64), and the cache holds global tensors."""
    model = build(family)
    ids = token_ids(4, 6, seed=3)

    def steps(m, to_ids):
        out = m(input_ids=to_ids(ids[:, :4]), use_cache=True)
        logits, cache = [out.logits], out.cache
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)   # past_key_values: use cache
            out = m(input_ids=to_ids(ids[:, 4:5]), past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        out = m(input_ids=to_ids(ids[:, 5:6]), cache=out.cache, use_cache=True)
        return logits + [out.logits], out.cache

    want, _ = steps(model, lambda x: x)

    def body():
        pl = _flat()
        m = sf.parallel.apply(model, pl, {"*": sf.B})
        logits, cache = steps(m, lambda x: sf.tensor(x, pl, sf.S(0)))
        keys = cache.layers[0].keys
        return [g.full_tensor() for g in logits], type(keys), keys.sbp, tuple(keys.shape)
    got, key_type, key_sbp, key_shape = sf.launch(body, world_size=WORLD)[0]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.detach(), rtol=1e-12, atol=1e-12)
    assert key_type is sf.GlobalTensor and key_sbp == (sf.S(0),) and key_shape[0] == 4
    assert key_shape[2] == 6   # 4 prefilled + 2 decoded positions


def test_dict_output_with_scores_and_logits_as_torch():
    """``return_dict_in_generate=True`` with ``output_scores`` / ``output_logits``: transformers'
    output class, its sequences, per-step scores and logits (and beam search's sequence scores)
    global tensors equal to torch's."""
    model = build("gpt2")
    kw = dict(do_sample=False, return_dict_in_generate=True, output_scores=True,
              output_logits=True)
    want = {"greedy": _generate(model, PROMPT, **kw),
            "beam": _generate(model, PROMPT, num_beams=2, **kw)}

    def body():
        pl = _flat()
        m = sf.parallel.apply(model, pl, {"*": sf.B})
        ids = sf.tensor(PROMPT, pl, sf.S(0))
        outs = {"greedy": _generate(m, ids, **kw), "beam": _generate(m, ids, num_beams=2, **kw)}
        return {n: (type(o), {k: v.full_tensor() if isinstance(v, sf.GlobalTensor) else
                              tuple(t.full_tensor() for t in v) for k, v in o.items()
                              if v is not None and k != "past_key_values" and k != "cache"})
                for n, o in outs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)   # the beam buffer
        got = sf.launch(body, world_size=WORLD)[0]
    for name, (kind, fields) in got.items():
        assert kind is type(want[name]) and set(fields) >= {"sequences", "scores", "logits"}
        for key, value in fields.items():
            ref = want[name][key]
            for g, w in zip(value if isinstance(value, tuple) else (value,),
                            ref if isinstance(ref, tuple) else (ref,)):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=(name, key))


SPLIT = {"gpt2": "transformer.h.1", "llama": "model.layers.1"}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_pipeline_generates_torchs_tokens_and_samples_as_any_layout(family):
    """A 2-stage pipeline (stages of 2 data-parallel ranks, the ids given on stage 0): each
    forward's logits come back to the ids' stage, the cache stays on the layers' stages (beam
    search reorders each on its stage). Greedy (an end-of-sequence id stopping row 0) and beam
    search give torch's tokens on stage 0; sampling the tokens of the same seed with the weights
    replicated on all 4 ranks."""
    model = build(family)
    searches = _searches(model)
    want = {k: _generate(model, PROMPT, **kw) for k, kw in searches.items()}

    def sampled(m, ids):
        sf.manual_seed(5)
        return _generate(m, ids, do_sample=True).full_tensor()

    def body():
        pl = _flat()
        flat = sampled(sf.parallel.apply(model, pl, {"*": sf.B}), sf.tensor(PROMPT, pl, sf.S(0)))
        stages = [sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])]
        m = sf.nn.from_torch(model, stages[0])
        sf.parallel.pipeline(m, stages, split=[SPLIT[family]], rules=[{"*": sf.B}] * 2)
        ids = sf.tensor(PROMPT, stages[0], sf.S(0))
        got = {k: _generate(m, ids, **kw) for k, kw in searches.items()}
        return ({k: (list(g.placement.flat_ranks), g.full_tensor()) for k, g in got.items()},
                (flat, sampled(m, ids)))
    with warnings.catch_warnings():   # beam search writes the prompt into a torch.full buffer
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        got, (flat, piped) = sf.launch(body, world_size=WORLD)[0]
    for k in want:
        assert got[k][0] == [0, 1] and torch.equal(got[k][1], want[k]), (family, k, got[k])
    assert torch.equal(piped, flat), (piped, flat)
