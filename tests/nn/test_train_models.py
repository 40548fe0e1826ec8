"""The example models (``sbpflow.models``: GPT, VGG-style CNN, Wide & Deep) trained a few steps
in data-parallel, tensor-parallel (Megatron column -> row), 2-D hybrid (2x2), ZeRO and fully
replicated layouts give the losses and weights of their torch twin trained on one device
(float64). One ``sf.launch`` per (model, layout); every optimizer of a case trains its own copy
of the model inside it."""

import pytest
import torch

import sbpflow as sf
from sbpflow.models import gpt_class, layout, vgg_class, wide_deep_class

F64 = torch.float64
STEPS = 5
RTOL, ATOL = 1e-5, 1e-9

# tiny sizes: the point is the layouts, not the model
GPT = dict(vocab=32, d=16, heads=2, layers=2, seq=8, batch=4)
VGG = dict(channels=(3, 4, 8), image=8, classes=10, hidden=12, batch=8)
WD = dict(vocab=50, dim=4, fields=3, dense=5, hidden=12, batch=8)

OPTIMIZERS = {
    "adamw": (lambda ps: sf.optim.AdamW(ps, lr=0.01, weight_decay=0.01),
              lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01, foreach=False)),
    "sgd": (lambda ps: sf.optim.SGD(ps, lr=0.05, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False)),
}


def _build(model: str, nn, F, cat):
    if model == "gpt":
        return gpt_class(nn, F)(GPT["vocab"], GPT["d"], GPT["heads"], GPT["layers"], GPT["seq"])
    if model == "vgg":
        return vgg_class(nn, F)(VGG["channels"], VGG["image"], VGG["classes"], VGG["hidden"])
    return wide_deep_class(nn, F, cat)(WD["vocab"], WD["dim"], WD["fields"], WD["dense"],
                                       WD["hidden"])


def _inputs(model: str) -> list:
    """The forward arguments, the same batch every step (so the loss must go down): (torch
    value, batched?) — batched inputs take the layout's data sbp, the others are replicated."""
    g = torch.Generator().manual_seed(100)
    if model == "gpt":
        tok = torch.randint(0, GPT["vocab"], (GPT["batch"], GPT["seq"] + 1), generator=g)
        return [(tok[:, :-1].contiguous(), True), (torch.arange(GPT["seq"]), False),
                (tok[:, 1:].contiguous(), True)]
    if model == "vgg":
        n, c = VGG["batch"], VGG["channels"][0]
        return [(torch.randn(n, c, VGG["image"], VGG["image"], generator=g, dtype=F64), True),
                (torch.randint(0, VGG["classes"], (n,), generator=g), True)]
    n = WD["batch"]
    ids = torch.randint(0, WD["vocab"], (n, WD["fields"]), generator=g)
    ids[0, 0] = WD["vocab"] - 1  # a row of the last vocab shard is looked up
    return [(ids, True), (torch.randn(n, WD["dense"], generator=g, dtype=F64), True),
            (torch.randint(0, 2, (n,), generator=g), True)]


def _sf_run(model: str, layout_name: str, opt_names: tuple):
    """On every rank: for each optimizer, build the model (same seed: same weights), lay it
    out, train STEPS steps. Returns the initial state dict, the per-optimizer (losses, final
    state dict) and the parameters' nd-sbps."""
    lay = layout(model, layout_name, sf.world_size())
    out, sd0, sbps = {}, None, None
    for opt_name in opt_names:
        sf.manual_seed(0)
        m = _build(model, sf.nn, sf.nn.functional, sf.cat).double()
        sd0 = m.state_dict()
        sf.parallel.apply(m, lay.placement, lay.rules, zero=lay.zero)
        sbps = {n: p.sbp for n, p in m.named_parameters()}
        opt = OPTIMIZERS[opt_name][0](m.parameters())
        bsbp = (sf.B,) * lay.placement.ndim
        losses = []
        for step in range(STEPS):
            args = [sf.tensor(v, lay.placement, lay.data_sbp if batched else bsbp)
                    for v, batched in _inputs(model)]
            opt.zero_grad()
            loss = m(*args)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[opt_name] = (losses, m.state_dict())
    return sd0, out, sbps


def _torch_run(model: str, sd0: dict, opt_name: str):
    m = _build(model, torch.nn, torch.nn.functional, torch.cat).double()
    m.load_state_dict(sd0)
    opt = OPTIMIZERS[opt_name][1](m.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = m(*(v for v, _ in _inputs(model)))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, m.state_dict()


def _close(a, b, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64),
                               rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


# what a layout must have done to the parameters (so a rule typo cannot make a test vacuous)
EXPECTED = {
    ("gpt", "tp"): {"blocks.0.attn.qkv.weight": (sf.S(0),), "blocks.1.mlp.proj.weight":
                    (sf.S(1),), "tok.weight": (sf.B,)},
    ("gpt", "2d"): {"blocks.1.attn.qkv.bias": (sf.B, sf.S(0)),
                    "blocks.0.attn.proj.weight": (sf.B, sf.S(1)),
                    "blocks.0.attn.proj.bias": (sf.B, sf.B), "head.weight": (sf.B, sf.B)},
    ("gpt", "zero"): {"blocks.0.ln1.weight": (sf.S(0),), "head.weight": (sf.S(0),)},
    ("vgg", "tp"): {"features.0.weight": (sf.S(0),), "features.7.weight": (sf.S(1),),
                    "classifier.3.weight": (sf.S(1),), "classifier.3.bias": (sf.B,)},
    ("vgg", "2d"): {"features.5.bias": (sf.B, sf.S(0)), "classifier.1.weight": (sf.B, sf.S(0))},
    ("wide_deep", "tp"): {"embedding.weight": (sf.S(0),), "deep.2.weight": (sf.S(1),)},
    ("wide_deep", "2d"): {"embedding.weight": (sf.B, sf.S(0))},
}

CASES = [
    ("gpt", "dp", ("adamw",)),
    ("gpt", "tp", ("adamw",)),
    ("gpt", "2d", ("adamw",)),
    ("gpt", "zero", ("adamw",)),
    ("gpt", "replicated", ("adamw",)),
    ("vgg", "dp", ("adamw", "sgd")),
    ("vgg", "tp", ("adamw", "sgd")),
    ("vgg", "2d", ("adamw", "sgd")),
    ("vgg", "zero", ("adamw", "sgd")),
    ("vgg", "replicated", ("adamw", "sgd")),
    ("wide_deep", "dp", ("adamw",)),
    ("wide_deep", "tp", ("adamw", "sgd")),   # the table split over its vocabulary
    ("wide_deep", "2d", ("adamw",)),
    ("wide_deep", "zero", ("adamw",)),
    ("wide_deep", "replicated", ("adamw",)),
]


@pytest.mark.parametrize("model,layout_name,opt_names", CASES,
                         ids=[f"{m}-{l}" for m, l, _ in CASES])
def test_training_matches_torch_twin(model, layout_name, opt_names):
    sd0, runs, sbps = sf.launch(_sf_run, world_size=4, args=(model, layout_name, opt_names))[0]
    for name, nd in EXPECTED.get((model, layout_name), {}).items():
        assert sbps[name] == nd, f"{name}: laid out {sbps[name]}, expected {nd}"
    for opt_name in opt_names:
        losses, sd = runs[opt_name]
        t_losses, t_sd = _torch_run(model, sd0, opt_name)
        _close(losses, t_losses, f"{opt_name} losses")
        assert losses[-1] < losses[0], f"{opt_name}: the loss did not go down: {losses}"
        assert set(sd) == set(t_sd)
        for k, v in t_sd.items():
            _close(sd[k], v, f"{opt_name} {k}")
            assert not torch.equal(v, sd0[k]), f"{opt_name}: {k} was not trained"
