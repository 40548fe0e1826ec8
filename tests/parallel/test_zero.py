"""ZeRO stages 1-3 (issue 15): training equals the torch twin on one device (float64) for the
example models at every stage, on 1-D and 2-D meshes with uneven shards, with gradient
accumulation and clipping, activation checkpointing, bf16 autocast and in graph mode; the bytes
each stage sends per step are its formula; checkpoints move between ZeRO and other layouts.
Memory per rank is in tests/test_memory.py."""

import functools

import pytest
import torch

import sbpflow as sf
from sbpflow.models import TP_RULES, gpt_class, mlp_class, vgg_class, wide_deep_class

B, S, F64 = sf.B, sf.S, torch.float64
RTOL, ATOL = 1e-5, 1e-9
# 18 features, 30 tokens: rows split 5, 5, 4, 4 over 4 ranks (uneven shards everywhere)
GPT = dict(vocab=30, d=18, heads=2, layers=2, seq=8)
BATCH = 8
MESHES = {
    "1d": ([0, 1, 2, 3], {"*": B}, (S(0),)),
    "2d": ([[0, 1], [2, 3]], {k: (B, v) for k, v in TP_RULES["gpt"].items()}, (S(0), B)),
}


def _gpt(nn, F):
    return gpt_class(nn, F)(**GPT)


def _gpt_batch(step: int) -> list:
    g = torch.Generator().manual_seed(100 + step)
    tok = torch.randint(0, GPT["vocab"], (BATCH, GPT["seq"] + 1), generator=g)
    return [tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()]


def _sf_args(batch: list, pl, data_sbp) -> list:
    rep = (B,) * pl.ndim
    return [sf.tensor(batch[0], pl, data_sbp), sf.tensor(batch[1], pl, rep),
            sf.tensor(batch[2], pl, data_sbp)]


def _micro(batch: list, k: int, n: int) -> list:
    """Micro-batch ``k`` of ``n`` (rows of the tokens and targets)."""
    rows = BATCH // n
    return [batch[0][k * rows:(k + 1) * rows], batch[1], batch[2][k * rows:(k + 1) * rows]]


def _train(model, opt, args_of, steps: int, micro: int, clip, on_sf: bool) -> list:
    """``steps`` steps of ``micro`` accumulated micro-batches (the loss of each divided by
    ``micro``: the mean over the batch; sbpflow's all but the last under ``opt.no_sync()``),
    clipping to ``clip``; returns the losses."""
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(micro):
            ctx = opt.no_sync() if on_sf and k < micro - 1 else _null()
            with ctx:
                loss = model(*args_of(step, k)) / micro
                loss.backward()
            total += loss.item()
        if clip is not None:
            (sf.optim.clip_grad_norm_ if on_sf else torch.nn.utils.clip_grad_norm_)(
                model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


VARIANTS = {"plain": (3, 1, None), "accum-clip": (2, 2, 0.05)}   # steps, micro-batches, clip


def _sf_gpt_runs(mesh: str, stages=(1, 2, 3)) -> dict:
    ranks, rules, data_sbp = MESHES[mesh]
    pl = sf.placement("cpu", ranks)
    out = {}
    for stage in stages:
        for variant, (steps, micro, clip) in VARIANTS.items():
            sf.manual_seed(0)
            m = _gpt(sf.nn, sf.nn.functional).double()
            sd0 = m.state_dict()
            sf.parallel.apply(m, pl, rules, zero=stage)
            sbps = {n: p.sbp for n, p in m.named_parameters()}
            opt = sf.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.01)
            losses = _train(m, opt, lambda s, k: _sf_args(_micro(_gpt_batch(s), k, micro), pl,
                                                          data_sbp),
                            steps, micro, clip, True)
            state = {n: st["exp_avg"].local.shape for n, st in
                     zip([n for n, _ in m.named_parameters()], opt.state.values())}
            out[(stage, variant)] = dict(sd0=sd0, losses=losses, sd=m.state_dict(), sbps=sbps,
                                         state=state)
    return out


def _torch_gpt(sd0: dict, variant: str):
    steps, micro, clip = VARIANTS[variant]
    m = _gpt(torch.nn, torch.nn.functional).double()
    m.load_state_dict(sd0)
    opt = torch.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.01, foreach=False)
    losses = _train(m, opt, lambda s, k: _micro(_gpt_batch(s), k, micro), steps, micro, clip,
                    False)
    return losses, m.state_dict()


def _close(a, b, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64),
                               rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@functools.cache
def gpt_runs(mesh: str):
    return sf.launch(_sf_gpt_runs, 4, args=(mesh,))


# what each stage must have done (so a rule typo cannot make a test vacuous): stored layouts
STORED = {
    ("1d", 1): {"blocks.0.attn.qkv.weight": (B,)},
    ("1d", 2): {"blocks.0.attn.qkv.weight": (S(0),)},
    ("1d", 3): {"blocks.0.attn.qkv.weight": (S(0),), "tok.weight": (S(0),),
                "blocks.1.ln2.bias": (S(0),)},
    # ZeRO along dp (mesh dim 0) inside the Megatron layout: a column-parallel weight splits
    # its input axis (its output axis is cut by tp after dp), a row-parallel one its output
    # axis; a column-parallel bias has no such axis and stays as it is; replicated ones split
    # along both mesh dims
    ("2d", 3): {"blocks.0.attn.qkv.weight": (S(1), S(0)), "blocks.0.attn.proj.weight":
                (S(0), S(1)), "blocks.0.attn.qkv.bias": (B, S(0)), "head.weight": (S(0), S(0))},
}


@pytest.mark.parametrize("mesh", ["1d", "2d"])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_training_equals_torch(mesh, stage, variant):
    """Every stage, both meshes; ``accum-clip``: two micro-batches (the first under
    ``opt.no_sync()``) and ``clip_grad_norm_`` to a norm the gradients exceed."""
    res = gpt_runs(mesh)
    r0 = res[0][(stage, variant)]
    want_losses, want_sd = _torch_gpt(r0["sd0"], variant)
    for rank, r in enumerate(res):
        got = r[(stage, variant)]
        _close(got["losses"], want_losses, f"rank {rank} losses")
        for k, v in want_sd.items():
            _close(got["sd"][k], v, f"rank {rank} {k}")
    for name, sbp in STORED.get((mesh, stage), {}).items():
        assert r0["sbps"][name] == sbp, name
    if (mesh, stage) == ("1d", 1):   # the optimizer state of a B weight is split: 54 rows
        assert [r[(1, "plain")]["state"]["blocks.0.attn.qkv.weight"][0] for r in res] == \
            [14, 14, 13, 13]


# -- the other example models --------------------------------------------------------------------
MODELS = {
    "mlp": (lambda nn, F, cat: mlp_class(nn, F)((10, 13, 7, 5)),
            lambda g: [torch.randn(8, 10, generator=g, dtype=F64),
                       torch.randint(0, 5, (8,), generator=g)]),
    "vgg": (lambda nn, F, cat: vgg_class(nn, F)((3, 4, 6), 8, 10, 12),
            lambda g: [torch.randn(8, 3, 8, 8, generator=g, dtype=F64),
                       torch.randint(0, 10, (8,), generator=g)]),
    "wide_deep": (lambda nn, F, cat: wide_deep_class(nn, F, cat)(50, 4, 3, 5, 12),
                  lambda g: [torch.randint(0, 50, (8, 3), generator=g),
                             torch.randn(8, 5, generator=g, dtype=F64),
                             torch.randint(0, 2, (8,), generator=g)]),
}


def _model_runs(name: str) -> dict:
    build, inputs = MODELS[name]
    pl = sf.placement("cpu", [0, 1, 2, 3])
    out = {}
    for stage in (1, 2, 3):
        sf.manual_seed(0)
        m = build(sf.nn, sf.nn.functional, sf.cat).double()
        sd0 = m.state_dict()
        sf.parallel.apply(m, pl, {"*": B}, zero=stage)
        opt = sf.optim.AdamW(m.parameters(), lr=0.02)
        losses = []
        for step in range(2):
            args = [sf.tensor(v, pl, S(0)) for v in inputs(torch.Generator().manual_seed(step))]
            loss = m(*args)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[stage] = (sd0, losses, m.state_dict())
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_other_models_train_as_torch_at_every_stage(name):
    build, inputs = MODELS[name]
    res = sf.launch(_model_runs, 4, args=(name,))
    for stage in (1, 2, 3):
        sd0, losses, sd = res[0][stage]
        m = build(torch.nn, torch.nn.functional, torch.cat).double()
        m.load_state_dict(sd0)
        opt = torch.optim.AdamW(m.parameters(), lr=0.02, foreach=False)
        want = []
        for step in range(2):
            loss = m(*inputs(torch.Generator().manual_seed(step)))
            loss.backward()
            opt.step()
            opt.zero_grad()
            want.append(loss.item())
        _close(losses, want, f"{name} stage {stage} losses")
        for k, v in m.state_dict().items():
            _close(sd[k], v, f"{name} stage {stage} {k}")


# -- bytes per step ------------------------------------------------------------------------------
SIZES = (16, 32, 32, 8)   # every weight and bias divides by 4: 1864 float32 elements
P = (16 * 32 + 32 + 32 * 32 + 32 + 32 * 8 + 8) * 4


def _second_step_stats(m, opt, x):
    """`sf.comm.stats()` of the second of two training steps of ``m`` on ``x`` (the first
    warms up), ZeRO-1's background all-gathers settled before each count starts and after."""
    for _ in range(2):
        sf.parallel.zero.settle()
        sf.comm.reset_stats()
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    sf.parallel.zero.settle()
    return sf.comm.stats()


def _bytes_per_step() -> dict:
    pl = sf.placement("cpu", [0, 1, 2, 3])
    out = {}
    for stage in (0, 1, 2, 3):
        sf.manual_seed(0)
        m = mlp_class(sf.nn, sf.nn.functional)(SIZES)
        sf.parallel.apply(m, pl, {"*": B}, zero=stage)
        opt = sf.optim.AdamW(m.parameters())
        x = sf.randn(8, SIZES[0], placement=pl, sbp=S(0), seed=1)
        out[stage] = {k: v.sent for k, v in _second_step_stats(m, opt, x).kinds.items()}
    return out


def test_bytes_per_step_are_the_formulas():
    """Per rank and step (N = 4): data parallelism all-reduces 2|P|(N-1)/N; stages 1 and 2
    send the same as one reduce-scatter (during backward) and one all-gather (after the
    update, in the background: `settle` waits for it); stage 3 gathers in
    forward and again in backward: 3|P|(N-1)/N, less the units whose weights backward does
    not read (the first Linear: its input needs no gradient, so it saves no weight)."""
    share = P * 3 // 4
    first = (16 * 32 + 32) * 4 * 3 // 4
    for r in sf.launch(_bytes_per_step, 4):
        assert r[0] == {"all_reduce": 2 * share}
        for stage in (1, 2):
            assert r[stage] == {"reduce_scatter": share, "all_gather": share}, stage
        assert r[3] == {"reduce_scatter": share, "all_gather": 2 * share - first}


# -- zero_min_size: small parameters stay as their rule says -------------------------------------
SMALL = 100   # the biases (32, 32 and 8 elements) stay; the weights (512, 1024, 256) are split
MLP_MESHES = {"1d": ([0, 1, 2, 3], {"*": B}, (S(0),)),
              "2d": ([[0, 1], [2, 3]], {k: (B, v) for k, v in TP_RULES["mlp"].items()},
                     (S(0), B))}


def _min_size_runs(mesh: str) -> dict:
    ranks, rules, data_sbp = MLP_MESHES[mesh]
    pl = sf.placement("cpu", ranks)
    out = {}
    for stage in (0, 1, 2, 3):
        sf.manual_seed(0)
        m = mlp_class(sf.nn, sf.nn.functional)(SIZES).double()
        sd0 = m.state_dict()
        sf.parallel.apply(m, pl, rules, zero=stage, zero_min_size=SMALL)
        sbps = {n: p.sbp for n, p in m.named_parameters()}
        opt = sf.optim.AdamW(m.parameters(), lr=0.02)
        x = sf.tensor(_MLP_X, pl, data_sbp)
        stats = _second_step_stats(m, opt, x)
        sent = {k: v.sent for k, v in stats.kinds.items() if v.sent}
        state = {n: opt.state[p]["exp_avg"].local.numel() for n, p in m.named_parameters()}
        out[stage] = dict(sd0=sd0, sbps=sbps, sent=sent, sd=m.state_dict(), state=state)
    return out


def _torch_mlp(sd0: dict) -> dict:
    m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
    m.load_state_dict(sd0)
    opt = torch.optim.AdamW(m.parameters(), lr=0.02, foreach=False)
    for _ in range(2):
        m(_MLP_X).sum().backward()
        opt.step()
        opt.zero_grad()
    return m.state_dict()


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_zero_min_size_keeps_small_parameters_as_their_rule_says(mesh):
    """Weights at least ``SMALL`` elements: split (stored S at stages 2 and 3, split
    optimizer state at 1); biases: their rule's layout, whole state, gradients all-reduced
    along dp as without ZeRO. Training equals torch; per rank and step the split weights
    move as each stage's formula and nothing else changes: data parallelism's all-reduce of
    their local gradients (``L`` bytes a rank over dp groups of ``n``: 2L(n-1)/n) becomes a
    reduce-scatter and an all-gather of L(n-1)/n each, stage 3 all-gathers again in
    backward (not the first Linear, whose input needs no gradient)."""
    res = sf.launch(_min_size_runs, 4, args=(mesh,))
    _, rules, _ = MLP_MESHES[mesh]
    ranks = 4 if mesh == "1d" else 2                  # along the data-parallel dims
    tp = 1 if mesh == "1d" else 2
    weights = {"net.0.weight": 512, "net.2.weight": 1024, "net.4.weight": 256}
    local = {n: k * 8 // tp for n, k in weights.items()}   # float64 compute shards
    moved = sum(local.values()) * (ranks - 1) // ranks
    first = local["net.0.weight"] * (ranks - 1) // ranks
    r0 = res[0]
    want_sd = _torch_mlp(r0[0]["sd0"])
    for r in res:
        for stage in (0, 1, 2, 3):
            for k, v in want_sd.items():
                _close(r[stage]["sd"][k], v, f"stage {stage} {k}")
    base = r0[0]["sent"]
    for stage in (1, 2, 3):
        got = r0[stage]
        for name, sbp in got["sbps"].items():
            if name in weights and stage >= 2:
                assert sbp != r0[0]["sbps"][name] and sf.B not in sbp, name
            else:
                assert sbp == r0[0]["sbps"][name], name
        for name, n in got["state"].items():
            assert n == r0[0]["state"][name] // (ranks if name in weights else 1), name
        want = dict(base)
        want["all_reduce"] = base["all_reduce"] - 2 * moved
        want["reduce_scatter"] = base.get("reduce_scatter", 0) + moved
        want["all_gather"] = base.get("all_gather", 0) + moved + (
            moved - first if stage == 3 else 0)
        assert got["sent"] == want, (stage, got["sent"], base)


def _shard_after_a_step(stage: int, w0: torch.Tensor, x: torch.Tensor) -> dict:
    pl = sf.placement("cpu", [0, 1])
    m = sf.parallel.apply(sf.nn.Linear(4, 3, bias=False), pl, {"*": B})
    with torch.no_grad():
        m.weight.local.copy_(w0)
    opt = sf.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    xs = sf.tensor(x, pl, S(0))
    for step in range(2):
        m(xs).square().sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            try:
                sf.parallel.zero.shard(m, stage)
            except sf.errors.OptimizerStateError as e:
                refused = str(e)
            else:
                refused = None
    return {"refused": refused, "sbp": m.weight.sbp, "w": m.weight.full_tensor()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shard_after_the_first_step_is_refused(stage):
    """The contract (docs/zero.md): shard before the optimizer's first step; after it, the
    stage would be ignored (the step set up its gradient sync and update), so it raises naming
    the parameter, changes nothing, and training goes on as torch's."""
    g = torch.Generator().manual_seed(3)
    w0, x = torch.randn(3, 4, generator=g), torch.randn(6, 4, generator=g)
    got = sf.launch(_shard_after_a_step, 2, args=(stage, w0, x))
    tw = torch.nn.Parameter(w0.clone())
    topt = torch.optim.SGD([tw], lr=0.1, momentum=0.9)
    for _ in range(2):
        (x @ tw.T).square().sum().backward()
        topt.step()
        topt.zero_grad()
    for r in got:
        assert r["refused"] is not None and "'weight'" in r["refused"] and \
            "before the optimizer's first step" in r["refused"], r["refused"]
        assert r["sbp"] == (B,)
        torch.testing.assert_close(r["w"], tw.detach(), rtol=1e-5, atol=1e-6)


def test_a_bad_zero_min_size_names_the_argument():
    m = sf.nn.Linear(2, 2)
    for bad in (-5, "10", 2.5, True):
        with pytest.raises(sf.SbpError, match="must be an int >= 0"):
            sf.parallel.zero.shard(m, 1, min_size=bad)
        with pytest.raises(sf.SbpError, match="GraphConfig.enable_zero.*int >= 0"):
            sf.nn.Graph().config.enable_zero(3, min_size=bad)
        with pytest.raises(sf.SbpError, match="sf.parallel.apply.*int >= 0"):
            sf.parallel.apply(m, sf.placement("cpu", [0]), {"*": (sf.B,)}, zero=3,
                              zero_min_size=bad)


# -- checkpoints across layouts ------------------------------------------------------------------
TARGETS = {   # name: (mesh, zero stage)
    "dp": ("1d", 0), "zero1": ("1d", 1), "zero2": ("1d", 2), "2d": ("2d", 0),
    "2d-zero3": ("2d", 3), "zero3": ("1d", 3)}


def _laid_out(name: str, seed: int):
    mesh, stage = TARGETS[name]
    ranks, rules, data_sbp = MESHES[mesh]
    pl = sf.placement("cpu", ranks)
    sf.manual_seed(seed)
    m = _gpt(sf.nn, sf.nn.functional).double()
    sf.parallel.apply(m, pl, rules, zero=stage)
    opt = sf.optim.AdamW(m.parameters(), lr=0.02)
    loss = m(*_sf_args(_gpt_batch(seed), pl, data_sbp))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return m, opt, pl, data_sbp


def _next_loss(m, opt, pl, data_sbp) -> float:
    loss = m(*_sf_args(_gpt_batch(9), pl, data_sbp))
    loss.backward()
    opt.step()
    return loss.item()


def _round_trips(path: str) -> dict:
    src, sopt, spl, ssbp = _laid_out("zero3", 0)
    sf.save(path + "/zero3", src, sopt)
    want = (src.state_dict(), sopt.state_dict(), _next_loss(src, sopt, spl, ssbp))
    out = {}
    for name in [n for n in TARGETS if n != "zero3"]:
        m, opt, pl, dsbp = _laid_out(name, 1)           # other weights, another state
        sf.load(path + "/zero3", m, opt)
        got = (m.state_dict(), opt.state_dict())
        sf.save(path + f"/{name}", m, opt)              # and back into ZeRO-3
        back, bopt, bpl, bsbp = _laid_out("zero3", 2)
        sf.load(path + f"/{name}", back, bopt)
        out[name] = (got, _next_loss(m, opt, pl, dsbp), back.state_dict(), bopt.state_dict(),
                     _next_loss(back, bopt, bpl, bsbp))
    return dict(want=want, out=out)


def test_a_zero3_checkpoint_loads_into_any_layout_and_back(tmp_path):
    res = sf.launch(_round_trips, 4, args=(str(tmp_path),))
    for r in res:
        sd, osd, loss = r["want"]
        for name, (got, next_loss, back_sd, back_osd, back_loss) in r["out"].items():
            for k, v in sd.items():
                _close(got[0][k], v, f"{name}: {k}")
                _close(back_sd[k], v, f"{name} and back: {k}")
            for i, st in osd["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    _close(got[1]["state"][i][key], st[key], f"{name}: state {i} {key}")
                    _close(back_osd["state"][i][key], st[key], f"back: state {i} {key}")
            # the next step is the same step
            _close(next_loss, loss, f"{name}: next loss")
            _close(back_loss, loss, f"{name} and back: next loss")


# -- activation checkpointing, autocast, graph mode, parallelize ---------------------------------
def _recompute_runs() -> dict:
    F = sf.nn.functional
    GPTClass = gpt_class(sf.nn, F)

    class Recomputed(GPTClass):
        def forward(self, tokens, positions, targets):
            x = self.tok(tokens) + self.pos(positions)
            for block in self.blocks:
                x = sf.nn.checkpoint(block, x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    pl = sf.placement("cpu", [0, 1, 2, 3])
    out = {}
    for stage in (1, 2, 3):
        sf.manual_seed(0)
        m = Recomputed(**GPT).double()
        sd0 = m.state_dict()
        sf.parallel.apply(m, pl, {"*": B}, zero=stage)
        opt = sf.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.01)
        losses = _train(m, opt, lambda s, k: _sf_args(_gpt_batch(s), pl, (S(0),)), 3, 1, None,
                        True)
        out[stage] = (sd0, losses, m.state_dict())
    return out


def test_activation_checkpointing_of_zero_units_equals_torch():
    """Each block (a ZeRO unit) under ``sf.nn.checkpoint``: recomputation gathers the unit
    again (stage 3; stage 2 computes with its whole copies, stage 1 with the parameters);
    the result is the torch twin's without checkpointing."""
    res = sf.launch(_recompute_runs, 4)
    for stage in (1, 2, 3):
        sd0, losses, sd = res[0][stage]
        want_losses, want_sd = _torch_gpt(sd0, "plain")
        _close(losses, want_losses, f"stage {stage} losses")
        for k, v in want_sd.items():
            _close(sd[k], v, f"stage {stage} {k}")


def _autocast_runs(mesh: str, stages: tuple, make_opt) -> dict:
    """{stage: (losses, state_dict)} of 3 bf16-autocast steps of the GPT laid out on ``mesh``
    at each of ``stages`` (the same seed, batches and optimizer ``make_opt(params)``)."""
    ranks, rules, data_sbp = MESHES[mesh]
    pl = sf.placement("cpu", ranks)
    out = {}
    for stage in stages:
        sf.manual_seed(0)
        m = _gpt(sf.nn, sf.nn.functional)
        sf.parallel.apply(m, pl, rules, zero=stage)
        opt = make_opt(m.parameters())
        losses = []
        for step in range(3):
            with sf.autocast(torch.bfloat16):
                loss = m(*_sf_args(_gpt_batch(step), pl, data_sbp))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[stage] = (losses, m.state_dict())
    return out


def test_bf16_autocast_zero3_equals_data_parallel():
    """The same bf16 kernels on the gathered weights: ZeRO-3 gives data parallelism's losses
    and weights (float32 master weights, up to the order of the gradient reductions)."""
    res = sf.launch(_autocast_runs, 4, args=("1d", (0, 3),
                    lambda ps: sf.optim.AdamW(ps, lr=0.02)))[0]
    (dp_losses, dp_sd), (z_losses, z_sd) = res[0], res[3]
    assert z_losses[0] != pytest.approx(z_losses[-1])   # it trains
    torch.testing.assert_close(torch.tensor(z_losses), torch.tensor(dp_losses), rtol=1e-4,
                               atol=1e-5)
    for k, v in dp_sd.items():
        torch.testing.assert_close(z_sd[k], v, rtol=1e-3, atol=1e-5, msg=k)


def test_bf16_autocast_on_a_2d_mesh_equals_the_2d_layout_at_every_stage():
    """ZeRO along dp inside the Megatron layout (2 x 2), bf16 autocast, float32 weights, SGD
    (a step proportional to the gradient, so bf16's rounding shows as it is, not magnified
    as Adam's normalisation does where a gradient is near zero): every stage gives the plain
    2-D layout's losses and weights within bf16's resolution. (Stage 1 is bit-equal; stages 2
    and 3 round some matmuls differently: the tensor-parallel attention projection's output
    comes out split where the plain layout keeps it partial.)"""
    res = sf.launch(_autocast_runs, 4, args=("2d", (0, 1, 2, 3),
                    lambda ps: sf.optim.SGD(ps, lr=0.5)))[0]
    base_losses, base_sd = res[0]
    assert base_losses[0] != pytest.approx(base_losses[-1], abs=1e-3)   # it trains
    for stage in (1, 2, 3):
        losses, sd = res[stage]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(base_losses), rtol=2e-4,
                                   atol=0, msg=f"stage {stage}")
        for k, v in base_sd.items():
            torch.testing.assert_close(sd[k], v, rtol=0, atol=5e-4, msg=f"stage {stage} {k}")


class _Step(sf.nn.Graph):
    def __init__(self, model, opt, stage):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.enable_zero(stage)

    def build(self, *args):
        loss = self.model(*args)
        loss.backward()
        return loss


def _graph_runs(mesh: str) -> dict:
    ranks, rules, data_sbp = MESHES[mesh]
    pl = sf.placement("cpu", ranks)
    out = {}
    for stage in (1, 2, 3):
        for graph in (False, True):
            sf.manual_seed(0)
            m = _gpt(sf.nn, sf.nn.functional).double()
            sf.parallel.apply(m, pl, rules, zero=0 if graph else stage)
            opt = sf.optim.AdamW(m.parameters(), lr=0.02)
            step = _Step(m, opt, stage) if graph else None
            losses = []
            for s in range(3):
                args = _sf_args(_gpt_batch(s), pl, data_sbp)
                if graph:
                    losses.append(step(*args).item())
                else:
                    loss = m(*args)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
            out[(stage, graph)] = (losses, m.state_dict(),
                                   {n: p.sbp for n, p in m.named_parameters()})
    return out


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_graph_enable_zero_equals_eager(mesh):
    """``config.enable_zero(stage)`` on a data-parallel (1d) or dp x Megatron (2d) model
    equals ``sf.parallel.apply(..., zero=stage)`` run eagerly, and leaves the parameters in
    the same stored layouts."""
    res = sf.launch(_graph_runs, 4, args=(mesh,))[0]
    for stage in (1, 2, 3):
        (el, esd, esbp), (gl, gsd, gsbp) = res[(stage, False)], res[(stage, True)]
        _close(gl, el, f"stage {stage} losses")
        for k, v in esd.items():
            _close(gsd[k], v, f"stage {stage} {k}")
        assert gsbp == esbp
    want = (S(0),) if mesh == "1d" else (S(1), S(0))   # column parallel: tp cuts axis 0
    assert res[(3, True)][2]["blocks.0.mlp.fc.weight"] == want


def _parallelized(stage: int) -> tuple:
    from sbpflow.auto.space import Strategy, make_layer_strategy
    from sbpflow.auto.trace import trace
    sf.manual_seed(0)
    m = _gpt(sf.nn, sf.nn.functional).double()
    sd0 = m.state_dict()
    pl = sf.placement("cpu", [0, 1, 2, 3])
    batch = _gpt_batch(0)
    graph, _ = trace(m, batch)
    strategy = Strategy(graph, [make_layer_strategy(l, (4,), ("dp",), zero=stage)
                                for l in graph.layers])
    plan = sf.auto.parallelize(m, batch, pl, strategy=strategy)
    opt = sf.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.01)
    losses = []
    for s in range(3):
        loss = m(*[plan.input(v) for v in _gpt_batch(s)])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = opt.state[m.blocks[0].attn.qkv.weight]["exp_avg"].local.shape
    return sd0, losses, m.state_dict(), {n: p.sbp for n, p in m.named_parameters()}, state


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parallelize_runs_each_layers_zero_stage(stage):
    """A strategy whose layers have ZeRO stage 1, 2 or 3 (``LayerStrategy.zero``) trains as
    the torch twin; stage 1 keeps the weights whole (``B``) with split optimizer state, 2 and
    3 store them split."""
    res = sf.launch(_parallelized, 4, args=(stage,))
    sd0, losses, sd, sbps, _ = res[0]
    want = (B,) if stage == 1 else (S(0),)
    assert sbps["blocks.0.attn.qkv.weight"] == want and sbps["head.weight"] == want
    assert [r[4][0] for r in res] == [14, 14, 13, 13]   # 54 rows of qkv's state, split
    want_losses, want_sd = _torch_gpt(sd0, "plain")
    _close(losses, want_losses, "losses")
    for k, v in want_sd.items():
        _close(sd[k], v, k)


def _optimizer_before(stage: int) -> str:
    m = mlp_class(sf.nn, sf.nn.functional)((8, 8, 4)).double()
    early = sf.optim.AdamW(m.parameters(), lr=0.02)
    pl = sf.placement("cpu", [0, 1])
    sf.parallel.apply(m, pl, {"*": B}, zero=stage)
    late = sf.optim.AdamW(m.parameters(), lr=0.02)
    m(sf.randn(4, 8, placement=pl, sbp=S(0), seed=1, dtype=F64)).sum().backward()
    w0 = m.net[0].weight.full_tensor().clone()
    late.step()   # built after apply: trains
    assert not torch.equal(m.net[0].weight.full_tensor(), w0)
    try:
        early.step()
    except sf.SbpError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("stage", [0, 3])
def test_an_optimizer_built_before_apply_refuses_to_step(stage):
    """Its parameters are the replaced objects, which no forward uses: a step would silently
    change nothing, so it raises naming the parameter and the fix."""
    for msg in sf.launch(_optimizer_before, 2, args=(stage,)):
        assert "'net.0.weight'" in msg and "sf.parallel.apply replaced it" in msg
        assert "build the optimizer after sf.parallel.apply (it replaces the parameters)" in \
            msg.lower()


def test_bad_stage_names_the_fix():
    pl = sf.placement("cpu", [0])
    for bad in (4, -1, True, 3.0, "3", None):
        with pytest.raises(sf.SbpError, match="zero must be one of"):
            sf.parallel.apply(sf.nn.Linear(2, 2), pl, {"*": B}, zero=bad)


def _meta_vs_real() -> tuple:
    pl = sf.placement("cpu", [0, 1, 2, 3])
    out = []
    for meta in (True, False):
        sf.manual_seed(0)
        with sf.nn.init.meta_init() if meta else _null():
            m = _gpt(sf.nn, sf.nn.functional)
        sf.parallel.apply(m, pl, {"*": B}, zero=3)
        out.append(({n: (p.sbp, tuple(p.local.shape), p.local.is_meta)
                     for n, p in m.named_parameters()}, m.state_dict()))
    return out


def test_a_meta_model_is_materialised_straight_into_its_zero3_shards():
    res = sf.launch(_meta_vs_real, 4)
    for (meta, meta_sd), (real, real_sd) in res:
        assert meta == real and not any(is_meta for _, _, is_meta in meta.values())
        for k, v in real_sd.items():
            assert torch.equal(meta_sd[k], v), k
    # 30 rows: 8, 8, 7, 7
    assert [r[0][0]["tok.weight"][:2] for r in res] == [((S(0),), (n, 18)) for n in (8, 8, 7, 7)]


# -- the bucket rule the gradient syncs share (sbpflow.gradsync.BucketSync) -----------------------
def _buckets_started() -> dict:
    """On the 2-D layout each sync fills buckets of two groups at once (a tp-split weight is
    reduced along dp, a replicated one over all 4 ranks), so their buckets interleave; small
    buckets make many. After a backward: was every bucket started during it?"""
    from sbpflow.gradsync import GradSync
    from sbpflow.zero.shard_sync import ShardSync
    ranks, rules, data_sbp = MESHES["2d"]
    pl = sf.placement("cpu", ranks)
    out = {}
    for stage, make in ((0, GradSync), (1, ShardSync)):
        sf.manual_seed(0)
        m = _gpt(sf.nn, sf.nn.functional).double()
        sf.parallel.apply(m, pl, rules, zero=stage)
        sync = make(list(m.parameters()), 2000)
        m(*_sf_args(_gpt_batch(0), pl, data_sbp)).backward()
        groups = {b.group if stage == 0 else b.geos[0].group for b in sync._buckets}
        started = [(b.pending if stage == 0 else b.future) is not None for b in sync._buckets]
        out[stage] = (len(groups), started)
        sync.take()
    return out


def test_interleaved_buckets_all_start_during_backward():
    for r in sf.launch(_buckets_started, 4):
        for stage, (groups, started) in r.items():
            assert groups == 2 and len(started) > 4, (stage, groups, started)
            assert all(started), (stage, started)


# -- reads right after a ZeRO-1 / ZeRO-2 step wait for the background all-gather ----------------
def _read_after_step() -> dict:
    """The ZeRO worker is held busy 0.3 s, so the all-gather after the update is still queued
    when the parameters are read: ``p.local`` (and an op on ``p``) must wait for it."""
    import threading
    from sbpflow.zero.worker import submit
    pl = sf.placement("cpu", [0, 1, 2, 3])
    out = {}
    for stage in (1, 2):
        sf.manual_seed(0)
        m = mlp_class(sf.nn, sf.nn.functional)(SIZES).double()
        sd0 = m.state_dict()
        sf.parallel.apply(m, pl, {"*": B}, zero=stage)
        opt = sf.optim.AdamW(m.parameters(), lr=0.02)
        x = sf.tensor(_MLP_X, pl, S(0))
        m(x).sum().backward()
        busy = threading.Event()
        submit(busy.wait, 5.0)
        threading.Timer(0.3, busy.set).start()
        opt.step()
        w = m.net[0].weight
        kinds = type(w).__name__
        first = w.local.clone()                  # stage 1: the whole weight (its layout is B)
        doubled = (m.net[2].weight * 2).full_tensor()
        out[stage] = dict(sd0=sd0, first=first, doubled=doubled, kind=kinds,
                          after=type(w) is sf.nn.Parameter, sbp=w.sbp, sd=m.state_dict())
    return out


_MLP_X = torch.randn(8, SIZES[0], generator=torch.Generator().manual_seed(3), dtype=F64)


def test_reading_a_parameter_right_after_the_step_waits_for_its_gather():
    res = sf.launch(_read_after_step, 4)
    for stage in (1, 2):
        r = res[0][stage]
        m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
        m.load_state_dict(r["sd0"])
        opt = torch.optim.AdamW(m.parameters(), lr=0.02, foreach=False)
        m(_MLP_X).sum().backward()
        opt.step()
        want = m.state_dict()
        assert r["kind"] == "Parameter" and r["after"], stage   # the same class, once settled
        if stage == 1:
            _close(r["first"], want["net.0.weight"], "stage 1 p.local")
        _close(r["doubled"], 2 * want["net.2.weight"], f"stage {stage} an op on p")
        for k, v in want.items():
            _close(r["sd"][k], v, f"stage {stage} {k}")


def _worker_waits_while_owner_computes() -> list:
    """Rank 1's ZeRO worker waits in an all-gather for rank 0's, which starts late; meanwhile
    rank 0's own thread waits in an all-reduce for rank 1's, which is still computing. Neither
    wait is stuck: each partner arrives later (a graph step's background gathers and the
    caller's ``loss.item()`` interleave so)."""
    import time
    from sbpflow.zero.worker import submit
    comm = sf.comm.current()
    x = torch.full((2,), float(comm.rank + 1))

    def gather(delay: float) -> list:
        time.sleep(delay)
        return comm.all_gather(x, [0, 1])

    if comm.rank == 0:
        time.sleep(0.3)   # rank 1's worker waits for rank 0's from the start
        fut = submit(gather, 0.6)
        total = comm.all_reduce(x, [0, 1])
    else:
        fut = submit(gather, 0.0)
        time.sleep(0.6)   # computing while rank 0 waits
        total = comm.all_reduce(x, [0, 1])
    return [total, *fut.result()]


def test_a_zero_workers_wait_is_not_taken_for_a_deadlock():
    """The threads backend's deadlock check follows one waiting thread a rank: a ZeRO
    worker's wait beside its rank's own thread must not form a false cycle (a flaky
    ``CommError: deadlock`` in graph + ZeRO tests before)."""
    for total, a, b in sf.launch(_worker_waits_while_owner_computes, 2):
        assert total.tolist() == [3.0, 3.0]
        assert a.tolist() == [1.0, 1.0] and b.tolist() == [2.0, 2.0]


# -- Module.to(dtype) after apply: the new parameters stay ZeRO's ----------------------------------
def _cast_after_apply() -> dict:
    """float32 model, ``sf.parallel.apply(..., zero=stage)``, then ``.double()`` (new parameter
    objects), the optimizer built after it; 2 steps, the second's bytes measured."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    out = {}
    for stage in (1, 2, 3):
        sf.manual_seed(0)
        m = mlp_class(sf.nn, sf.nn.functional)(SIZES)
        sd0 = m.state_dict()
        sf.parallel.apply(m, pl, {"*": B}, zero=stage)
        m.double()
        opt = sf.optim.AdamW(m.parameters(), lr=0.02)
        x = sf.tensor(_MLP_X, pl, S(0))
        stats = _second_step_stats(m, opt, x)
        sent = {k: v.sent for k, v in stats.kinds.items() if v.sent}
        w = m.net[0].weight
        out[stage] = dict(sd0=sd0, sd=m.state_dict(), sent=sent, dtype=w.dtype, sbp=w.sbp,
                          state=opt.state[w]["exp_avg"].local.shape)
    return out


def test_casting_after_apply_keeps_zero():
    """As if cast before: the weights train as torch's (float64), the bytes are each stage's
    formula (float64: twice float32's), the stored layouts and the split optimizer state
    stay."""
    share = P * 2 * 3 // 4
    first = (16 * 32 + 32) * 8 * 3 // 4
    res = sf.launch(_cast_after_apply, 4)
    for stage in (1, 2, 3):
        r = res[0][stage]
        m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
        m.load_state_dict(r["sd0"])
        opt = torch.optim.AdamW(m.parameters(), lr=0.02, foreach=False)
        for _ in range(2):
            m(_MLP_X).sum().backward()
            opt.step()
            opt.zero_grad()
        for k, v in m.state_dict().items():
            _close(r["sd"][k], v, f"stage {stage} {k}")
        assert r["dtype"] == F64
        assert r["sbp"] == ((B,) if stage == 1 else (S(0),)), stage
        assert r["state"] == (8, 16), stage   # the 32 x 16 weight split 4 ways
        gathered = share if stage < 3 else 2 * share - first
        assert r["sent"] == {"reduce_scatter": share, "all_gather": gathered}, (stage, r["sent"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_shard_on_a_sub_placement_gives_every_rank_one_layout(stage):
    """``zero.shard`` on a model laid out on ranks 0-1 of a 4-rank world (a pipeline stage's
    case): every rank takes the same layout (stage 2 left ranks 2-3 at B: ranks disagreed),
    and an SGD step then equals torch's."""
    g = torch.Generator().manual_seed(11)
    w0 = torch.randn(4, 6, generator=g, dtype=torch.float64)
    b0 = torch.zeros(4, dtype=torch.float64)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    ref = torch.nn.Linear(6, 4, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(w0)
        ref.bias.copy_(b0)
    ref(x).pow(2).mean().backward()
    with torch.no_grad():
        want = ref.weight - 0.1 * ref.weight.grad

    def body():
        pl = sf.placement("cpu", [0, 1])
        m = sf.nn.Linear(6, 4, dtype=torch.float64)
        sf.parallel.apply(m, pl, {"*": sf.B})
        with torch.no_grad():
            m.weight.copy_(sf.tensor(w0, pl, sf.B))
            m.bias.copy_(sf.tensor(b0, pl, sf.B))
        sf.parallel.zero.shard(m, stage)
        opt = sf.optim.SGD(m.parameters(), lr=0.1)
        m(sf.tensor(x, pl, sf.S(0))).pow(2).mean().backward()
        opt.step()
        return m.weight.sbp, m.state_dict()["weight"]
    got = sf.launch(body, world_size=4)
    assert len({sbp for sbp, _ in got}) == 1, [sbp for sbp, _ in got]
    torch.testing.assert_close(got[0][1], want, rtol=1e-12, atol=1e-12)
