"""`sf.parallel.pipeline` in eager mode: the GPT of issue 14 split into 2 and 4 stages (1-D
stage placements, data or tensor parallel stages, 2-D stages) trains exactly as its torch twin
on one device (float64); the model's inputs follow the stages that read them and get their own
layouts back; gradients cross the stage boundaries (also to a routed input); buffers move with
their stage; bad splits, placements and shared buffers or modules across stages are refused
naming what is wrong (tied weights across stages: tests/parallel/test_pipeline_tied.py)."""

import pytest
import torch

import sbpflow as sf
from pipeline_fns import F64, GPT, batch, torch_train, train_gpt
from sbpflow.models import TP_RULES, gpt_class

RTOL, ATOL = 1e-7, 1e-10
SPLIT4 = ["blocks.2", "blocks.4", "blocks.6"]


def _close(a, b, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64),
                               rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _check_training(run: dict, n: int) -> None:
    """Losses and final weights equal the torch twin's, every weight was trained."""
    t_losses, t_sd = torch_train(run["sd0"], n)
    _close(run["losses"], t_losses, "losses")
    assert set(run["sd"]) == set(t_sd)
    for k, v in t_sd.items():
        _close(run["sd"][k], v, k)
        assert not torch.equal(v, run["sd0"][k]), f"{k} was not trained"


def _stage_ranks(layouts: dict, names: dict) -> None:
    for name, ranks in names.items():
        assert layouts[name][0] == ranks, f"{name} on {layouts[name][0]}, expected {ranks}"


TP2 = {k: v for k, v in TP_RULES["gpt"].items()}
TP2D = {k: (sf.B, v) for k, v in TP_RULES["gpt"].items()}
CASES = {
    # name: (world, stage ranks, split, rules, data sbp, batch, expected layouts)
    "4-stages": (4, [[0], [1], [2], [3]], SPLIT4, None, sf.B, 4,
                 {"tok.weight": ([0], (sf.B,)), "pos.weight": ([0], (sf.B,)),
                  "blocks.1.mlp.proj.bias": ([0], (sf.B,)), "blocks.2.ln1.weight": ([1], (sf.B,)),
                  "blocks.5.attn.qkv.weight": ([2], (sf.B,)), "blocks.6.ln1.bias": ([3], (sf.B,)),
                  "ln_f.weight": ([3], (sf.B,)), "head.weight": ([3], (sf.B,))}),
    "2-stages": (4, [[0, 1], [2, 3]], ["blocks.4"], None, sf.B, 4,
                 {"blocks.3.mlp.fc.weight": ([0, 1], (sf.B,)),
                  "blocks.4.ln1.weight": ([2, 3], (sf.B,))}),
    # 2 stages x 2-way data parallel, a batch of 5: uneven shards
    "2-stages-dp": (4, [[0, 1], [2, 3]], ["blocks.4"], [{"*": sf.B}, {"*": sf.B}], sf.S(0), 5,
                    {"tok.weight": ([0, 1], (sf.B,)), "head.weight": ([2, 3], (sf.B,))}),
    "2-stages-tp": (4, [[0, 1], [2, 3]], ["blocks.4"], [TP2, TP2], sf.B, 4,
                    {"blocks.0.attn.qkv.weight": ([0, 1], (sf.S(0),)),
                     "blocks.7.mlp.proj.weight": ([2, 3], (sf.S(1),)),
                     "head.weight": ([2, 3], (sf.B,))}),
    # 2 stages, each a 2x2 mesh: data parallel across its rows, tensor parallel inside
    "2-stages-2d": (8, [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], ["blocks.4"], [TP2D, TP2D],
                    (sf.S(0), sf.B), 4,
                    {"blocks.1.attn.proj.weight": ([[0, 1], [2, 3]], (sf.B, sf.S(1))),
                     "blocks.6.mlp.fc.bias": ([[4, 5], [6, 7]], (sf.B, sf.S(0)))}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gpt_pipeline_trains_as_torch(case):
    world, ranks, split, rules, data_sbp, n, expected = CASES[case]
    run = sf.launch(train_gpt, world_size=world, args=(ranks, split, rules, data_sbp, n))[0]
    for name, (pl_ranks, nd) in expected.items():
        assert run["layouts"][name] == (pl_ranks, nd), f"{name}: {run['layouts'][name]}"
    assert run["inputs"] == [ranks[0]] * 3        # the inputs got their own placement back
    _check_training(run, n)


def test_entering_layout_by_stage():
    """``sbp=[None, f]``: tensors entering stage 1 take ``f(t)``; a 1-D stage followed by a
    2-D one replicates by default. The hook a user put on the stage's first module sees the
    moved activation; training still equals torch."""
    seen = []

    def spy(model):
        model.blocks[4].register_forward_pre_hook(
            lambda m, a: seen.append((str(a[0].placement), a[0].sbp)))

    def fn(stage_ranks, sbp):
        return train_gpt(stage_ranks, ["blocks.4"], None, sf.B, 4, sbp=sbp, after=spy)

    split_batch = [None, lambda t: (sf.S(0),) if t.ndim >= 2 else (sf.B,)]
    run = sf.launch(fn, world_size=4, args=([[0, 1], [2, 3]], split_batch))[0]
    _check_training(run, 4)
    assert set(seen) == {("cpu[2,3]", (sf.S(0),))}
    seen.clear()
    run = sf.launch(fn, world_size=4, args=([[0, 1], [[2], [3]]], None))[0]
    _check_training(run, 4)
    assert set(seen) == {("cpu[[2],[3]]", (sf.B, sf.B))}


# -- a small model whose input is read by both stages, with a buffer in stage 1 ------------------
def _net(nn, F, buffer):
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", buffer)

        def forward(self, h):
            return h * self.w

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.s = nn.Linear(3, 4), nn.Linear(4, 3), Scale()
            self.fail = False

        def forward(self, x, t):
            h = self.s(self.b(F.tanh(self.a(x))))
            if self.fail:
                raise RuntimeError("boom after stage 1")
            return ((h - t) ** 2).mean() + (h * x).sum()   # x is read again in stage 1

    return Net()


def _net_data():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(5, 3, generator=g, dtype=F64), torch.randn(5, 3, generator=g, dtype=F64),
            torch.tensor([1.0, -2.0, 3.0], dtype=F64))


def _pipelined_net(w):
    """Rank function part: the small net in float64, its state before, pipelined in two
    stages on ranks [0, 1] and [2, 3] at module "b"."""
    pl0, pl1 = sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])
    sf.manual_seed(0)
    m = _net(sf.nn, sf.nn.functional, sf.tensor(w, sf.placement("cpu", [0, 1, 2, 3]),
                                                 sf.B)).double()
    sd0 = m.state_dict()
    sf.parallel.pipeline(m, [pl0, pl1], split=["b"])
    return m, sd0, pl0, pl1


def test_routed_input_gradient_buffer_and_restore():
    x_full, t_full, w = _net_data()

    def fn():
        m, sd0, pl0, pl1 = _pipelined_net(w)
        x = sf.tensor(x_full, pl0, sf.S(0)).requires_grad_()
        t = sf.tensor(t_full, pl0, sf.S(0))
        loss = m(x, t=t)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        out = dict(sd0=sd0, loss=loss.item(), x_grad=x.grad.full_tensor(), grads=grads,
                   buffer=m.s.w.placement.ranks, x=(x.placement.ranks, x.sbp),
                   t=(t.placement.ranks, t.sbp))
        everyone = sf.placement("cpu", [0, 1, 2, 3])   # inputs made off stage 0 go there first
        out["loss_everyone"] = m(sf.tensor(x_full, everyone, sf.S(0)),
                                 sf.tensor(t_full, everyone, sf.B)).item()
        m.fail = True
        with pytest.raises(RuntimeError, match="boom"):
            m(x, t)
        out["after_error"] = (x.placement.ranks, t.placement.ranks,
                              len(sf.parallel.pipeline_of(m)._frames))
        return out

    out = sf.launch(fn, world_size=4)[0]
    tm = _net(torch.nn, torch.nn.functional, w)
    tm.double().load_state_dict(out["sd0"])
    x = x_full.clone().requires_grad_()
    loss = tm(x, t_full)
    loss.backward()
    _close(out["loss"], loss.item(), "loss")
    _close(out["loss_everyone"], loss.item(), "loss, inputs on every rank")
    _close(out["x_grad"], x.grad, "input gradient (two stages read it)")
    for n, p in tm.named_parameters():
        _close(out["grads"][n], p.grad, n)
    assert out["buffer"] == [2, 3]
    assert out["x"] == ([0, 1], (sf.S(0),)) and out["t"] == ([0, 1], (sf.S(0),))
    assert out["after_error"] == ([0, 1], [0, 1], 0)


# -- modules that run out of their registration order (as Hugging Face models' do) -----------------
def _out_of_order_net():
    """A torch model whose ``post`` is registered before the blocks and runs after them (OPT's final_layer_norm),
    ``pre`` and ``rot`` (a buffer only: Llama's rotary_emb) after them and run before; the
    blocks take a tuple made before them (Llama's ``position_embeddings=(cos, sin)``); the
    forward reads a value in Python (HF's padding warning: ``pad_token_id in input_ids``)."""
    nn, F = torch.nn, torch.nn.functional

    class Rot(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("freq", torch.tensor([1.0, 0.5, 0.25, 0.125], dtype=F64))

        def forward(self, h):
            return torch.cos(h * self.freq), torch.sin(h * self.freq)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, h, rotary=None):
            cos, sin = rotary
            return F.tanh(self.lin(h)) * cos + sin

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.post = nn.Linear(4, 2)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.pre = nn.Linear(3, 4)
            self.rot = Rot()

        def forward(self, x, t):
            if 7.0 in t:
                raise ValueError("not in the data")
            h = self.pre(x)
            rotary = self.rot(h)
            for block in self.blocks:
                h = block(h, rotary=rotary)
            return ((self.post(h) - t) ** 2).mean()
    return Net()


@pytest.mark.parametrize("micro_batches", [0, 2], ids=["eager", "graph-1f1b-M2"])
def test_modules_run_in_the_stage_that_calls_them(micro_batches):
    """Each module holding tensors goes, on the first call, to the stage that runs it (``pre``,
    ``rot`` to stage 0, ``post`` to stage 1), a tuple argument of the stage's first module
    moves with it, and a value read in Python during a graph's trace is no stage: 2 SGD steps
    equal torch's, eager and in graph mode (1F1B)."""
    g = torch.Generator().manual_seed(3)
    x_full, t_full = torch.randn(4, 3, generator=g, dtype=F64), torch.randn(4, 2, generator=g,
                                                                            dtype=F64)

    torch.manual_seed(0)
    tm = _out_of_order_net().double()   # a torch model, converted

    def fn():
        stages = [sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])]
        m = sf.nn.from_torch(tm, stages[0])
        sf.parallel.pipeline(m, stages, split=["blocks.1"])
        opt = sf.optim.SGD(m.parameters(), lr=0.1)
        step = _train_step(m, opt, micro_batches) if micro_batches else None
        losses = []
        for _ in range(2):
            x, t = sf.tensor(x_full, stages[0], sf.S(0)), sf.tensor(t_full, stages[0], sf.S(0))
            if step is None:
                loss = m(x, t)
                loss.backward()
                opt.step()
                opt.zero_grad()
            else:
                loss = step(x, t)
            losses.append(loss.item())
        where = {n: t.placement.ranks for n, t in [*m.named_parameters(), *m.named_buffers()]}
        return losses, m.state_dict(), where

    losses, sd, where = sf.launch(fn, world_size=4)[0]
    assert where == {"post.weight": [2, 3], "post.bias": [2, 3], "blocks.0.lin.weight": [0, 1],
                     "blocks.0.lin.bias": [0, 1], "blocks.1.lin.weight": [2, 3],
                     "blocks.1.lin.bias": [2, 3], "pre.weight": [0, 1], "pre.bias": [0, 1],
                     "rot.freq": [0, 1]}
    opt = torch.optim.SGD(tm.parameters(), lr=0.1)
    for i in range(2):
        loss = tm(x_full, t_full)
        loss.backward()
        opt.step()
        opt.zero_grad()
        _close(losses[i], loss.item(), f"loss {i}")
    for k, v in tm.state_dict().items():
        _close(sd[k], v, k)


def test_a_module_called_in_two_stages_is_refused():
    """A module (holding weights) that the first call runs in stage 0 and again in stage 1 lives
    on one stage only: `ParallelizeError` naming it and both stages, before any value is wrong."""
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])
            self.shared = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.shared(self.blocks[1](self.blocks[0](self.shared(x)))).sum()

    torch.manual_seed(0)
    tm = Twice().double()

    def fn():
        stages = [sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])]
        m = sf.nn.from_torch(tm, stages[0])
        sf.parallel.pipeline(m, stages, split=["blocks.1"])
        with pytest.raises(sf.errors.ParallelizeError) as info:
            m(sf.tensor(torch.ones(2, 3, dtype=F64), stages[0], sf.B))
        return str(info.value)

    msg = sf.launch(fn, world_size=4)[0]
    assert "'shared' ran in stages 0 and 1" in msg, msg


def _train_step(model, opt, micro_batches: int):
    class Step(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(micro_batches)
            self.config.set_pipeline_schedule("1f1b")

        def build(self, x, t):
            loss = self.model(x, t)
            loss.backward()
            return loss
    return Step()


class _Interrupt(BaseException):
    """Not an Exception (as KeyboardInterrupt): forward hooks with ``always_call`` miss it."""


def test_inputs_restored_when_a_later_stage_raises_a_base_exception():
    """A BaseException (custom, KeyboardInterrupt) raised in stage 1 leaves the inputs with
    their own shards and layouts and no frame behind; the model then runs as its torch twin."""
    x_full, t_full, w = _net_data()

    def raising(exc, inputs: tuple, seen: list):
        def hook(module, args):         # on stage 1's module, after the inputs were moved there
            seen.append(tuple(i.placement.ranks for i in inputs))
            raise exc()
        return hook

    def fn():
        m, sd0, pl0, pl1 = _pipelined_net(w)
        x = sf.tensor(x_full, pl0, sf.S(0))
        t = sf.tensor(t_full, pl0, sf.B)
        own, after, seen = (x.local, t.local), [], []
        for exc in (_Interrupt, KeyboardInterrupt):
            handle = m.s.register_forward_pre_hook(raising(exc, (x, t), seen))
            with pytest.raises(exc):
                m(x, t)
            handle.remove()
            after.append((x.placement.ranks, x.sbp, t.placement.ranks, t.sbp,
                          x.local is own[0] and t.local is own[1],
                          len(sf.parallel.pipeline_of(m)._frames)))
        return sd0, seen, after, m(x, t).item()

    sd0, seen, after, loss = sf.launch(fn, world_size=4)[0]
    assert seen == [([2, 3], [2, 3])] * 2
    assert after == [([0, 1], (sf.S(0),), [0, 1], (sf.B,), True, 0)] * 2
    tm = _net(torch.nn, torch.nn.functional, w)
    tm.double().load_state_dict(sd0)
    _close(loss, tm(x_full, t_full).item(), "loss after the interrupts")


def test_pipeline_again_replaces_hooks():
    """A second call leaves only its own hooks; the stage move runs before a hook the user
    had put on the stage's first module (it sees the moved activation)."""
    def fn():
        sf.manual_seed(0)
        m = gpt_class(sf.nn, sf.nn.functional)(**GPT).double()
        pls = [sf.placement("cpu", [r]) for r in range(4)]
        seen = []
        m.blocks[3].register_forward_pre_hook(lambda mod, a: seen.append(str(a[0].placement)))
        sf.parallel.pipeline(m, pls, split=SPLIT4)
        sf.parallel.pipeline(m, pls[:2], split=["blocks.3"])
        pipe = sf.parallel.pipeline_of(m)
        tok, pos, tgt = batch(0, 2)
        loss = m(*(sf.tensor(v, pls[0], sf.B) for v in (tok, pos, tgt)))
        hooks = {name: len(mod._forward_pre_hooks) for name, mod in m.named_modules()
                 if mod._forward_pre_hooks}   # (the first call's placing hooks are gone)
        pipe.remove()                  # the first pipeline's forward wrapper went with it too
        removed = ("forward" in m.__dict__, m.blocks[3]._forward_pre_hooks)
        return hooks, pipe.stage_of("blocks.2.ln1.weight"), pipe.stage_of("blocks.3"), \
            m.head.weight.placement.ranks, loss.placement.ranks, seen, removed

    hooks, s2, s3, head, loss, seen, removed = sf.launch(fn, world_size=4)[0]
    assert hooks == {"blocks.3": 2}              # the stage move and the user's hook
    assert removed[0] is False and len(removed[1]) == 1
    assert (s2, s3, head, loss) == (0, 1, [1], [1])
    assert seen == ["cpu[1]"]


# -- errors ---------------------------------------------------------------------------------------
def _errors():
    """Each bad call on a fresh GPT: (exception class name, message)."""
    pl = [sf.placement("cpu", [r]) for r in range(4)]

    def gpt():
        return gpt_class(sf.nn, sf.nn.functional)(**GPT)

    def shared():
        m = gpt()
        m.blocks._modules["5"] = m.blocks[1]
        return m

    cases = {
        "unknown": (gpt, dict(placements=pl[:2], split=["blocks.9"])),
        "order": (gpt, dict(placements=pl[:3], split=["blocks.4", "blocks.2"])),
        "twice": (gpt, dict(placements=pl[:3], split=["blocks.2", "blocks.2"])),
        "root": (gpt, dict(placements=pl[:2], split=[""])),
        "count": (gpt, dict(placements=pl[:2], split=SPLIT4)),
        "string": (gpt, dict(placements=pl[:2], split="blocks.2")),
        "overlap": (gpt, dict(placements=[sf.placement("cpu", [0, 1]),
                                          sf.placement("cpu", [1, 2])], split=["blocks.2"])),
        "not-placement": (gpt, dict(placements=[pl[0], [1]], split=["blocks.2"])),
        "outside-world": (gpt, dict(placements=[pl[0], sf.placement("cpu", [4])],
                                    split=["blocks.2"])),
        "rules-count": (gpt, dict(placements=pl[:2], split=["blocks.2"], rules=[{"*": sf.B}])),
        "rules-type": (gpt, dict(placements=pl[:2], split=["blocks.2"], rules=[None, "B"])),
        "rules-unmatched": (gpt, dict(placements=pl[:2], split=["blocks.2"],
                                      rules=[None, {"blocks.*": sf.B}])),
        "sbp": (gpt, dict(placements=pl[:2], split=["blocks.2"], sbp=[None, (sf.S(0), sf.B)])),
        "shared": (shared, dict(placements=pl[:2], split=["blocks.2"])),
        "shared-split": (shared, dict(placements=pl[:2], split=["blocks.5"])),
    }
    out = {}
    for name, (build, kwargs) in cases.items():
        try:
            sf.parallel.pipeline(build(), **kwargs)
        except sf.SbpError as exc:
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = None
    try:
        sf.parallel.pipeline(torch.nn.Linear(2, 2), pl[:1], split=[])
    except sf.SbpError as exc:
        out["torch-module"] = (type(exc).__name__, str(exc))
    # a residual around the split point (inside Block.forward) mixes two stages' tensors
    m = sf.parallel.pipeline(gpt(), pl[:2], split=["blocks.0.attn"])
    tok, pos, tgt = batch(0, 2)
    try:
        m(*(sf.tensor(v, pl[0], sf.B) for v in (tok, pos, tgt)))
    except sf.SbpError as exc:
        out["residual"] = (type(exc).__name__, str(exc))
    return out


EXPECTED_ERRORS = {
    "unknown": ("ParallelizeError", ["'blocks.9'", "not a module", "blocks.7"]),
    "order": ("ParallelizeError", ["order of named_modules()", "'blocks.2'", "'blocks.4'"]),
    "twice": ("ParallelizeError", ["'blocks.2' is given twice"]),
    "root": ("ParallelizeError", ["stage 0 starts at the model"]),
    "count": ("ParallelizeError", ["3 split point(s)", "4 stage(s)", "2 placement(s)"]),
    "string": ("ParallelizeError", ["list of module names", "'blocks.2'"]),
    "overlap": ("ParallelizeError", ["stages 0 (cpu[0,1]) and 1 (cpu[1,2])", "rank(s) [1]"]),
    "not-placement": ("ParallelizeError", ["stage 1", "[1]", "not an sf.placement"]),
    "outside-world": ("PlacementError", ["stage 1", "rank(s) [4]", "4 rank(s)"]),
    "rules-count": ("ParallelizeError", ["rules", "one entry a stage (2)"]),
    "rules-type": ("ParallelizeError", ["rules of stage 1", "'B'"]),
    "rules-unmatched": ("UnmatchedParameterError", ["stage 1", "ln_f.weight", "blocks.*"]),
    "sbp": ("SbpParseError", ["sbp of stage 1", "cpu[1]"]),
    "shared": ("ParallelizeError", ["blocks.1.ln1.weight", "blocks.5.ln1.weight",
                                    "one module called in stages [0, 1]"]),
    "shared-split": ("ParallelizeError", ["'blocks.5'", "several names", "blocks.1"]),
    "torch-module": ("ParallelizeError", ["sf.nn.Module", "Linear"]),
    "residual": ("PlacementMismatchError", ["cpu[0]", "cpu[1]", "different placements"]),
}


def test_errors_name_what_is_wrong():
    results = sf.launch(_errors, world_size=4)
    assert all(r == results[0] for r in results)     # every rank refuses alike
    out = results[0]
    assert set(out) == set(EXPECTED_ERRORS)
    for name, (cls, parts) in EXPECTED_ERRORS.items():
        assert out[name] is not None, f"{name}: no error"
        got_cls, msg = out[name]
        assert got_cls == cls, f"{name}: {got_cls}: {msg}"
        for part in parts:
            assert part in msg, f"{name}: {part!r} not in {msg!r}"


class _Net(sf.nn.Module):
    """``net``: Linear, ReLU, Linear; the model itself holds nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.net = sf.nn.Sequential(sf.nn.Linear(4, 4), sf.nn.ReLU(), sf.nn.Linear(4, 4))

    def forward(self, x):
        return self.net(x)


def _empty_stage_errors():
    pl = [sf.placement("cpu", [r]) for r in range(3)]
    out = []
    for split in (["net.0"], ["net"], ["net.0", "net.2"], ["net.1"], ["net.1", "net.2"]):
        try:
            sf.parallel.pipeline(_Net(), pl[:len(split) + 1], split=split)
            out.append(None)
        except sf.SbpError as exc:
            out.append((type(exc).__name__, str(exc)))
    gpt = gpt_class(sf.nn, sf.nn.functional)(**GPT)  # a stage of only a block, no layer of it
    try:
        sf.parallel.pipeline(gpt, pl, split=["blocks.2", "blocks.2.ln1"])
    except sf.errors.ParallelizeError as exc:
        out.append(str(exc))
    return out


def test_a_split_that_leaves_a_stage_empty_is_refused():
    """A split at the first module (``net.0``), or one that gives a stage only containers of
    the next stage's modules, would leave that stage's ranks idle; it is refused naming the
    split, the stage and a later module to split at (it was accepted, rank 0 silently
    idle)."""
    who = "sf.parallel.pipeline: split"
    idle = "and hold no parameter or buffer, so the ranks of stage"
    want = [
        ("ParallelizeError",
         f"{who} ['net.0'] leaves stage 0 empty: its modules ['(model)', 'net'] only contain "
         f"'net.0', where stage 1 starts, {idle} 0 would sit idle; split at a later module "
         f"(such as 'net.1', the first after 'net.0' and its children), or use one stage "
         f"fewer (drop split point 'net.0' and a placement)"),
        ("ParallelizeError",
         f"{who} ['net'] leaves stage 0 empty: its modules ['(model)'] only contain 'net', "
         f"where stage 1 starts, {idle} 0 would sit idle; use one stage fewer (drop split "
         f"point 'net' and a placement)"),
        ("ParallelizeError",
         f"{who} ['net.0', 'net.2'] leaves stage 0 empty: its modules ['(model)', 'net'] only "
         f"contain 'net.0', where stage 1 starts, {idle} 0 would sit idle; split at a later "
         f"module (such as 'net.1', the first after 'net.0' and its children), or use one "
         f"stage fewer (drop split point 'net.0' and a placement)"),
        None,
        None,
        f"{who} ['blocks.2', 'blocks.2.ln1'] leaves stage 1 empty: its modules ['blocks.2'] "
        f"only contain 'blocks.2.ln1', where stage 2 starts, {idle} 1 would sit idle; split "
        f"at a later module (such as 'blocks.2.attn', the first after 'blocks.2.ln1' and its "
        f"children), or use one stage fewer (drop split point 'blocks.2.ln1' and a placement)",
    ]
    assert sf.launch(_empty_stage_errors, world_size=3) == [want] * 3


@pytest.mark.gloo
def test_four_stages_on_gloo_processes():
    """The issue's 4-stage split on 4 processes: the boundary moves and their gradients go
    point to point over gloo."""
    ranks = [[0], [1], [2], [3]]
    run = sf.launch(train_gpt, world_size=4, backend="torch", args=(ranks, SPLIT4, None, sf.B, 4))
    _check_training(run[0], 4)
    assert run[3]["losses"] == run[0]["losses"]
