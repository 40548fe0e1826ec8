"""Hugging Face transformers models train unmodified on sbpflow (issue 36, part 1): each family of
`hf_zoo` (GPT2, Llama and Qwen2 with grouped-query attention, GPT-NeoX, Phi, OPT, BERT), built
from its config with its defaults (SDPA attention, ``use_cache``), converted by
`sf.parallel.apply` and called as its users call it (``model(input_ids=..., labels=...)``, HF's
own loss), takes 2 optimizer steps on 4 rank threads, data parallel and ZeRO 1-3, equal to the
same steps of the torch model on one device. Float64 models; the causal LMs' loss is float32
(HF's ``ForCausalLMLoss`` upcasts the logits), so their losses are compared at float32
tolerance (their gradients are the same float32 per-token terms in any batch split, so the
weights agree to float64 rounding); BERT's masked-LM loss is float64. No replicated fallback
runs (no "fallback" bytes in `sf.comm.stats()`)."""

from __future__ import annotations

import copy

import pytest
import torch

import sbpflow as sf
from hf_zoo import CAUSAL, ZOO, build, token_ids

STEPS = 2
WORLD = 4
W_TOL = dict(rtol=1e-9, atol=1e-12)


def _loss_tol(name: str) -> dict:
    return dict(rtol=1e-6, atol=1e-6) if name in CAUSAL else dict(rtol=1e-12, atol=1e-12)


def _optimizer(ns, params, kind: str):
    if kind == "adamw":
        return ns.AdamW(params, lr=1e-2, weight_decay=0.01)
    return ns.SGD(params, lr=0.5, momentum=0.9)


def _torch_train(model, ids: torch.Tensor, kind: str) -> tuple[list, dict, torch.dtype]:
    model = copy.deepcopy(model)
    opt = _optimizer(torch.optim, model.parameters(), kind)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict(), loss.dtype


def _sf_train(model, ids: torch.Tensor, zero: int, kind: str) -> dict:
    pl = sf.placement("cpu", list(range(WORLD)))
    m = sf.parallel.apply(model, pl, {"*": sf.B}, zero=zero)
    opt = _optimizer(sf.optim, m.parameters(), kind)
    sf.comm.reset_stats()
    losses = []
    for _ in range(STEPS):
        x = sf.tensor(ids, pl, sf.S(0))
        out = m(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    fallback = sf.comm.stats()["fallback"].recv
    cache = type(getattr(out, "past_key_values", None)).__name__
    return dict(losses=losses, sd=m.state_dict(), dtype=out.loss.dtype, fallback=fallback,
                logits=out.logits.sbp, cache=cache,
                layouts={n: p.sbp for n, p in m.named_parameters()})


def _check(name: str, got: dict, want: tuple, zero: int) -> None:
    losses, sd, dtype = want
    assert got["dtype"] == dtype
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses),
                               **_loss_tol(name))
    assert list(got["sd"]) == list(sd)
    for k, v in sd.items():
        torch.testing.assert_close(got["sd"][k], v, **W_TOL, msg=lambda m: f"{k}: {m}")
    assert got["fallback"] == 0, f"{name}: {got['fallback']} bytes gathered by the fallback"
    assert got["logits"] == (sf.S(0),)            # the activations stayed batch-split
    if name in CAUSAL:                             # the default cache was made and filled
        assert got["cache"] == "DynamicCache", got["cache"]
    want_sbp = (sf.S(0),) if zero >= 2 else (sf.B,)   # stage 2 keeps a whole copy
    assert all(s == want_sbp for s in got["layouts"].values()), got["layouts"]


CASES = [(name, zero, "adamw") for zero in (0, 3) for name in ZOO] + \
        [(name, zero, "sgd") for zero in (1, 2) for name in ZOO]


@pytest.mark.parametrize("name,zero,kind", CASES,
                         ids=[f"{n}-zero{z}-{k}" for n, z, k in CASES])
def test_hf_model_trains_as_torch(name, zero, kind):
    model, ids = build(name), token_ids()
    got = sf.launch(_sf_train, world_size=WORLD, args=(model, ids, zero, kind))[0]
    _check(name, got, _torch_train(model, ids, kind), zero)
