"""Hugging Face transformers models train unmodified on sbpflow (issue 36, part 1): each family of
`hf_zoo` (GPT2, Llama and Qwen2 with grouped-query attention, GPT-NeoX, Phi, OPT, BERT), built
from its config with its defaults (SDPA attention, ``use_cache``), converted by
`sf.parallel.apply` and called as its users call it (``model(input_ids=..., labels=...)``, HF's
own loss), takes 2 optimizer steps on 4 rank threads -- data parallel, ZeRO 1-3 (eager, and in a
graph), a 2-stage pipeline (eager, and a graph's 1F1B) -- equal to the same steps of the torch
model on one device. Float64 models; the causal LMs' loss is float32 (HF's ``ForCausalLMLoss``
upcasts the logits), so their losses are compared at float32 tolerance (their gradients are the
same float32 per-token terms in any batch split, so the weights agree to float64 rounding,
except over micro-batches: see the graph tests); BERT's masked-LM loss is float64. No replicated
fallback runs (no "fallback" bytes in `sf.comm.stats()`), but in a pipeline stage on a padded
batch the one that turns the padding mask into the attention mask."""

from __future__ import annotations

import copy

import pytest
import torch

import sbpflow as sf
from hf_zoo import CAUSAL, ZOO, build, token_ids, trained, transformers

STEPS = 2
WORLD = 4
W_TOL = dict(rtol=1e-9, atol=1e-12)
FLOAT32_LOSS = {*CAUSAL, "bloom"}     # HF's causal-LM loss: float32


def _loss_tol(name: str) -> dict:
    return dict(rtol=1e-6, atol=1e-6) if name in FLOAT32_LOSS else dict(rtol=1e-12, atol=1e-12)


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
    if name in FLOAT32_LOSS:                       # the default cache was made and filled
        assert got["cache"] == "DynamicCache", got["cache"]
    want_sbp = (sf.S(0),) if zero >= 2 else (sf.B,)   # stage 2 keeps a whole copy
    assert all(s == want_sbp for s in got["layouts"].values()), got["layouts"]


# ZeRO 1 and 2 on a learned-position decoder, a rotary GQA one and the encoder (keeps it fast)
CASES = [(name, zero, "adamw") for zero in (0, 3) for name in ZOO] + \
        [(name, zero, "sgd") for zero in (1, 2) for name in ("gpt2", "llama", "bert")]


@pytest.mark.parametrize("name,zero,kind", CASES,
                         ids=[f"{n}-zero{z}-{k}" for n, z, k in CASES])
def test_hf_model_trains_as_torch(name, zero, kind):
    model, ids = build(name), token_ids()
    got = sf.launch(_sf_train, world_size=WORLD, args=(model, ids, zero, kind))[0]
    _check(name, got, _torch_train(model, ids, kind), zero)


# -- 2-stage pipelines -----------------------------------------------------------------------------
SPLIT = {"gpt2": "transformer.h.1", "llama": "model.layers.1", "qwen2": "model.layers.1",
         "gpt_neox": "gpt_neox.layers.1", "phi": "model.layers.1",
         "opt": "model.decoder.layers.1", "bert": "bert.encoder.layer.1"}
# where modules registered out of their running order go (Llama's rotary_emb runs before the
# layers, OPT's final_layer_norm after them), and the last layer and the head
PLACED = {"gpt2": {"transformer.wpe.weight": [0, 1], "transformer.ln_f.weight": [2, 3]},
          "llama": {"model.rotary_emb.inv_freq": [0, 1], "lm_head.weight": [2, 3]},
          "opt": {"model.decoder.final_layer_norm.weight": [2, 3],
                  "model.decoder.layers.1.fc1.weight": [2, 3]}}


def _train_step(model, opt, micro_batches: int):
    class Step(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(micro_batches)
            if sf.parallel.pipeline_of(model) is not None:
                self.config.set_pipeline_schedule("1f1b")

        def build(self, x):
            loss = self.model(input_ids=x, labels=x).loss
            loss.backward()
            return loss
    return Step()


def _sf_pipeline(model, ids: torch.Tensor, name: str, micro_batches: int) -> dict:
    """Stages on ranks [0, 1] and [2, 3], each data parallel; the token ids (inputs and
    labels) given on stage 0: the labels follow to stage 1, where the loss reads them."""
    stages = [sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])]
    m = sf.nn.from_torch(model, stages[0])
    sf.parallel.pipeline(m, stages, split=[SPLIT[name]], rules=[{"*": sf.B}] * 2)
    opt = _optimizer(sf.optim, m.parameters(), "sgd")
    step = _train_step(m, opt, micro_batches) if micro_batches else None
    sf.comm.reset_stats()
    losses = []
    for _ in range(STEPS):
        x = sf.tensor(ids, stages[0], sf.S(0))
        if step is None:
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            loss = step(x)
        losses.append(loss.item())
    where = {n: t.placement.ranks for n, t in [*m.named_parameters(), *m.named_buffers()]}
    return dict(losses=losses, sd=m.state_dict(), where=where, loss_at=loss.placement.ranks,
                fallback=sf.comm.stats()["fallback"].recv)


PIPE_CASES = [(name, 0) for name in ZOO] + [("gpt2", 2), ("llama", 2)]


@pytest.mark.parametrize("name,micro_batches", PIPE_CASES,
                         ids=[f"{n}-{'eager' if k == 0 else f'graph-1f1b-M{k}'}"
                              for n, k in PIPE_CASES])
def test_hf_model_pipelined_trains_as_torch(name, micro_batches):
    """2 SGD steps. Eager: the stages run the whole batch, weights to float64 rounding. Graph
    (1F1B, 2 micro-batches): each micro-batch's float32 loss is its own mean, so the causal
    LMs' gradients differ from one batch's at float32 rounding: weights at float32 tolerance."""
    model, ids = build(name), token_ids()
    got = sf.launch(_sf_pipeline, world_size=WORLD, args=(model, ids, name, micro_batches))[0]
    losses, sd, _ = _torch_train(model, ids, "sgd")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses),
                               **_loss_tol(name))
    tol = W_TOL if micro_batches == 0 or name not in CAUSAL else dict(rtol=1e-6, atol=1e-7)
    for k, v in sd.items():
        torch.testing.assert_close(got["sd"][k], v, **tol, msg=lambda m: f"{k}: {m}")
    assert got["loss_at"] == [2, 3] and got["fallback"] == 0
    for k, ranks in PLACED.get(name, {}).items():
        assert got["where"][k] == ranks, (k, got["where"][k])


@pytest.mark.parametrize("name,zero", [("gpt2", 0), ("llama", 3)])
def test_hf_model_trains_as_torch_in_a_graph(name, zero):
    """Data parallel (and ZeRO-3) in graph mode, 2 micro-batches of a batch of 8: 2 SGD steps.
    The micro-batches' float32 means differ from one batch's at float32 rounding: weights at
    float32 tolerance."""
    model, ids = build(name), token_ids(batch=8)

    def run():
        pl = sf.placement("cpu", list(range(WORLD)))
        m = sf.parallel.apply(model, pl, {"*": sf.B}, zero=zero)
        step = _train_step(m, _optimizer(sf.optim, m.parameters(), "sgd"), 2)
        sf.comm.reset_stats()
        losses = [step(sf.tensor(ids, pl, sf.S(0))).item() for _ in range(STEPS)]
        return losses, m.state_dict(), sf.comm.stats()["fallback"].recv

    losses, sd, fallback = sf.launch(run, world_size=WORLD)[0]
    want_losses, want_sd, _ = _torch_train(model, ids, "sgd")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **_loss_tol(name))
    for k, v in want_sd.items():
        torch.testing.assert_close(sd[k], v, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")
    assert fallback == 0


# -- padded batches --------------------------------------------------------------------------------
def _padded() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids with left padding (rows 0 and 2), their attention mask, and labels ignoring the
    padded positions (-100), as a tokenizer's batch and a data collator give them."""
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 2)            # the pad token
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _torch_padded(model, batch: tuple) -> tuple[list, dict]:
    ids, mask, labels = batch
    model = copy.deepcopy(model)
    opt = _optimizer(torch.optim, model.parameters(), "sgd")
    losses = trained(lambda: model(input_ids=ids, attention_mask=mask, labels=labels).loss,
                     opt, STEPS)
    return losses, model.state_dict()


def _sf_padded(model, batch: tuple, name: str, layout: str) -> dict:
    if layout == "pipeline":
        stages = [sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])]
        m = sf.nn.from_torch(model, stages[0])
        sf.parallel.pipeline(m, stages, split=[SPLIT[name]], rules=[{"*": sf.B}] * 2)
        pl = stages[0]
    else:
        pl = sf.placement("cpu", list(range(WORLD)))
        m = sf.parallel.apply(model, pl, {"*": sf.B}, zero=3)
    opt = _optimizer(sf.optim, m.parameters(), "sgd")
    sf.comm.reset_stats()
    losses = []
    for _ in range(STEPS):
        ids, mask, labels = (sf.tensor(t, pl, sf.S(0)) for t in batch)
        loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, sd=m.state_dict(), fallback=sf.comm.stats()["fallback"].recv)


PAD_CASES = [(name, "zero3") for name in ("gpt2", "llama", "gpt_neox", "opt", "bert")] + \
    [(name, "pipeline") for name in ("gpt2", "llama", "bert")]


@pytest.mark.filterwarnings("ignore::sbpflow.nn.ReplicatedFallbackWarning")   # (its bytes checked)
@pytest.mark.parametrize("name,layout", PAD_CASES, ids=[f"{n}-{l}" for n, l in PAD_CASES])
def test_hf_model_trains_on_a_padded_batch_as_torch(name, layout):
    """A batch with an attention mask and ignored labels, ZeRO-3 or a 2-stage pipeline: 2 SGD
    steps equal torch's. The model turns the mask into its attention mask by advanced indexing
    (``padding_mask[batch_idx, kv_idx]``), which picks the mask's rows in order: on the whole
    world each rank indexes its own rows (no fallback); a stage's placement gathers the padding
    mask for it (at most its bytes as bools per forward), never an activation."""
    model, batch = build(name), _padded()
    got = sf.launch(_sf_padded, world_size=WORLD, args=(model, batch, name, layout))[0]
    losses, sd = _torch_padded(model, batch)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses),
                               **_loss_tol(name))
    for k, v in sd.items():
        torch.testing.assert_close(got["sd"][k], v, **W_TOL, msg=lambda m: f"{k}: {m}")
    bound = 0 if layout == "zero3" else STEPS * batch[0].numel()
    assert got["fallback"] <= bound, got["fallback"]


def test_bloom_with_its_custom_autograd_gelu_trains_as_torch():
    """BLOOM (beyond the zoo): ALiBi attention through ``torch.baddbmm(alibi, batch1=, batch2=,
    beta=, alpha=)`` and a GELU written as a custom ``torch.autograd.Function`` (before, its
    gradient stopped there silently), ZeRO-3: 2 SGD steps equal torch's."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "bloom", vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=2, n_layer=2,
        n_head=4, hidden_size=16)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    ids = token_ids()
    got = sf.launch(_sf_train, world_size=WORLD, args=(model, ids, 3, "sgd"))[0]
    _check("bloom", got, _torch_train(model, ids, "sgd"), 3)


@pytest.mark.parametrize("reentrant", [False, True], ids=["default", "reentrant"])
def test_llama_with_gradient_checkpointing_trains_as_torch(reentrant):
    """``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable`` before
    transformers 5; its default: torch's non-reentrant checkpoint; and ``use_reentrant=True``),
    data parallel: 2 SGD steps equal torch's."""
    model, ids = build("llama"), token_ids()
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    model.train()                                   # (checkpointing runs in training mode only)
    got = sf.launch(_sf_train, world_size=WORLD, args=(model, ids, 0, "sgd"))[0]
    losses, sd, _ = _torch_train(model, ids, "sgd")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses),
                               **_loss_tol("llama"))
    for k, v in sd.items():
        torch.testing.assert_close(got["sd"][k], v, **W_TOL, msg=lambda m: f"{k}: {m}")
