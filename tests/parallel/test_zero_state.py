"""ZeRO and the parameters' state changed after `sf.parallel.apply`: in-place writes (ops,
``p.data``, init functions) and loads after a cast reach the next forward at every stage (stage
2's whole copies are gathered again), freezing is honoured, eagerly and in graphs, and
``copy.deepcopy`` of a module (an EMA copy) is independent. Each compared with the torch twin
on one device in float64 (4 ranks, uneven shards: one rank holds no row of the last weight)."""

import pytest
import torch

import sbpflow as sf
from sbpflow.models import mlp_class

B, S, F64 = sf.B, sf.S, torch.float64
SIZES = (6, 10, 3)    # net.0.weight 10 x 6 (rows 3, 3, 2, 2), net.2.weight 3 x 10 (1, 1, 1, 0)
WRITTEN = ("net.0.weight", "net.2.weight")
LR = 0.1


def _batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, SIZES[0], generator=g, dtype=F64), \
        torch.randint(0, SIZES[-1], (8,), generator=g)


def _init_sd(scale: float = 1.0) -> dict:
    torch.manual_seed(0)
    m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
    return {k: v.detach() * scale + (0.01 if scale != 1.0 else 0.0)
            for k, v in m.state_dict().items()}


SD = _init_sd()
SD2 = _init_sd(0.5)    # the weights a load brings


def _value(shape) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel()), dtype=F64).reshape(shape) / 50 - 0.3


def _sf_value(t, shape):
    return sf.tensor(_value(shape), t.placement, (B,) * t.placement.ndim)


# each: (write on a torch tensor, write on an sbpflow parameter), under no_grad
WRITES = {
    "zero_": (lambda t: t.zero_(), lambda t: t.zero_()),
    "fill_": (lambda t: t.fill_(0.25), lambda t: t.fill_(0.25)),
    "mul_": (lambda t: t.mul_(0.5), lambda t: t.mul_(0.5)),
    "copy_": (lambda t: t.copy_(_value(t.shape)),
              lambda t: t.copy_(_sf_value(t, tuple(t.shape)))),
    "data.copy_": (lambda t: t.data.copy_(_value(t.shape)),
                   lambda t: t.data.copy_(_sf_value(t, tuple(t.shape)))),
    "setitem": (lambda t: t.__setitem__(slice(1, 3), 0.5),
                lambda t: t.__setitem__(slice(1, 3), 0.5)),
    "init.constant_": (lambda t: torch.nn.init.constant_(t, 0.2),
                       lambda t: torch.nn.init.constant_(t, 0.2)),
}


def _steps(model, opt, args_of, n: int = 2) -> list:
    """``n`` training steps on ``args_of(step)``: the losses (torch or sbpflow alike)."""
    losses = []
    for s in range(n):
        loss = model(*args_of(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _write(model, write) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in WRITTEN:
            write(params[name])


def _train_writing(model, opt, write, args_of) -> tuple:
    """Written right after being laid out, one step, written again right after the step
    (ZeRO 1-2's all-gather may be in flight), a step, a forward: the losses and weights."""
    losses = []
    _write(model, write)
    for s in range(2):
        loss = model(*args_of(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if s == 0:
            _write(model, write)
    losses.append(model(*args_of(2)).item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _torch_writing(write) -> tuple:
    m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
    m.load_state_dict(SD)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    return _train_writing(m, opt, write, _batch)


def _sf_args(pl):
    return lambda s: [sf.tensor(t, pl, S(0)) for t in _batch(s)]


def _sf_model(stage: int, pl):
    m = mlp_class(sf.nn, sf.nn.functional)(SIZES).double()
    m.load_state_dict(SD)
    sf.parallel.apply(m, pl, {"*": B}, zero=stage)
    return m


def _check(got: tuple, want: tuple, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got[0], dtype=F64), torch.tensor(want[0], dtype=F64),
                               rtol=1e-9, atol=1e-12, msg=lambda m: f"{what} losses: {m}")
    for k, v in want[1].items():
        torch.testing.assert_close(got[1][k], v, rtol=1e-9, atol=1e-12,
                                   msg=lambda m, k=k: f"{what} {k}: {m}")


# -- in-place writes after apply ---------------------------------------------------------------
@pytest.mark.parametrize("how", list(WRITES))
def test_an_in_place_write_after_apply_reaches_the_next_forward(how):
    """At every stage, a write to a parameter after `sf.parallel.apply` (before the first
    forward, and right after a step) is what the next forward computes with and what the
    optimizer updates, as torch. Stage 2 computed with its stale whole copy (another value on
    each rank) and the step wrote the stale parts back."""
    want = _torch_writing(WRITES[how][0])

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        out = {}
        for stage in (0, 1, 2, 3):
            m = _sf_model(stage, pl)
            opt = sf.optim.SGD(m.parameters(), lr=LR)
            out[stage] = _train_writing(m, opt, WRITES[how][1], _sf_args(pl))
        return out
    for rank, res in enumerate(sf.launch(body, 4)):
        for stage, got in res.items():
            _check(got, want, f"{how} stage {stage} rank {rank}")


def _rows(n: int, rank: int, world: int = 4) -> int:
    return n // world + (1 if rank < n % world else 0)


def test_only_a_write_gathers_stage_2s_copies_again():
    """Stage 2's whole copies are gathered again only when written: a step sends what the
    optimizer's update needs (its all-gather refills the copies; the next forward sends
    nothing), and a write adds one all-gather of the written parameters' shards at the
    forward that reads them."""
    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        m = _sf_model(2, pl)
        opt = sf.optim.SGD(m.parameters(), lr=LR)
        args = _sf_args(pl)
        sent = []
        for s in range(3):
            if s == 2:
                _write(m, WRITES["mul_"][1])
            sf.parallel.zero.settle()
            sf.comm.reset_stats()
            m(*args(s)).backward()
            opt.step()
            sf.parallel.zero.settle()
            sent.append({k: v.sent for k, v in sf.comm.stats().kinds.items() if v.sent})
        return sent
    for rank, sent in enumerate(sf.launch(body, 4)):
        assert sent[1] == sent[0], rank
        # this rank's rows of the written weights, sent to the 3 others (float64)
        mine = _rows(SIZES[1], rank) * SIZES[0] + _rows(SIZES[2], rank) * SIZES[1]
        assert sent[2] == {**sent[1], "all_gather": sent[1]["all_gather"] + mine * 8 * 3}, rank


class _Step(sf.nn.Graph):
    def __init__(self, model, opt, stage: int) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        if stage:
            self.config.enable_zero(stage)

    def build(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        return loss


# (stage given by sf.parallel.apply, stage given by config.enable_zero)
GRAPH_ZERO = [(2, 0), (3, 0), (0, 2), (0, 3)]


def test_an_in_place_write_between_graph_calls_reaches_the_next_call():
    """A graph over a ZeRO model (``apply(zero=)`` or ``enable_zero``) reads a parameter
    written between its calls, as torch (a graph over an ``apply(zero=2)`` model kept its
    stale whole copies)."""
    write = WRITES["mul_"]
    m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
    m.load_state_dict(SD)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    want = []
    for s in range(3):
        if s == 1:
            _write(m, write[0])
        loss = m(*_batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    want = (want, m.state_dict())

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        out = {}
        for applied, enabled in GRAPH_ZERO:
            m = _sf_model(applied, pl)
            step = _Step(m, sf.optim.SGD(m.parameters(), lr=LR), enabled)
            losses = []
            for s in range(3):
                if s == 1:
                    _write(m, write[1])
                losses.append(step(*_sf_args(pl)(s)).item())
            out[(applied, enabled)] = (losses, m.state_dict())
        return out
    for rank, res in enumerate(sf.launch(body, 4)):
        for key, got in res.items():
            _check(got, want, f"graph (apply zero, enable_zero) = {key} rank {rank}")


# -- a cast after apply, then a load -------------------------------------------------------------
LOADS = ("load_state_dict", "sf.load", "copy_")


@pytest.mark.parametrize("how", LOADS)
def test_a_load_after_a_cast_after_apply_is_what_training_uses(how, tmp_path):
    """``apply(zero=stage)`` on a float32 model, ``.double()`` (new parameters), then a load
    (``load_state_dict``, ``sf.load``, ``copy_`` of each parameter): the next forward and
    step use the loaded weights, as torch's float64 model given them. Stage 2 built the cast
    parameters' whole copies from the weights before the load and wrote them back."""
    m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
    m.load_state_dict(SD2)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    want = (_steps(m, opt, _batch), m.state_dict())
    path = str(tmp_path / "ckpt")

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        src = mlp_class(sf.nn, sf.nn.functional)(SIZES).double()
        src.load_state_dict(SD2)
        sf.parallel.apply(src, sf.placement("cpu", [0, 1]), {"*": B})
        sf.save(path, src)
        out = {}
        for stage in (0, 1, 2, 3):
            sf.manual_seed(1)
            m = mlp_class(sf.nn, sf.nn.functional)(SIZES)     # float32, other weights
            sf.parallel.apply(m, pl, {"*": B}, zero=stage)
            m.double()
            if how == "load_state_dict":
                m.load_state_dict(SD2)
            elif how == "sf.load":
                sf.load(path, m)
            else:
                with torch.no_grad():
                    for n, p in m.named_parameters():
                        p.copy_(sf.tensor(SD2[n], p.placement, (B,)))
            opt = sf.optim.SGD(m.parameters(), lr=LR)
            out[stage] = (_steps(m, opt, _sf_args(pl)), m.state_dict())
        return out
    for rank, res in enumerate(sf.launch(body, 4)):
        for stage, got in res.items():
            _check(got, want, f"{how} stage {stage} rank {rank}")


# -- freezing after apply ----------------------------------------------------------------------
FREEZE = {1: [("net.0.weight", False), ("net.2.bias", False)], 3: [("net.0.weight", True)]}
STEPS = 5


def _train_freezing(model, opt, args_of) -> tuple:
    """``STEPS`` steps; before step s, ``requires_grad_`` as `FREEZE` says: the losses, whether
    each frozen parameter had a gradient after each backward, the weights."""
    losses, had = [], []
    params = dict(model.named_parameters())
    for s in range(STEPS):
        for name, flag in FREEZE.get(s, ()):
            params[name].requires_grad_(flag)
        loss = model(*args_of(s))
        loss.backward()
        had.append(tuple(params[n].grad is not None for n, _ in FREEZE[1]))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, had, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _torch_freezing() -> tuple:
    m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
    m.load_state_dict(SD)
    return _train_freezing(m, torch.optim.Adam(m.parameters(), lr=0.05), _batch)


def test_freezing_after_apply_is_honoured_at_every_stage():
    """``requires_grad_(False)`` on a parameter after `sf.parallel.apply(..., zero=stage)`
    stops its gradient and its updates, and ``requires_grad_(True)`` later resumes them, as
    torch (and FSDP2). Stages 2 and 3 reduce-scattered a gradient for the frozen parameter
    and the optimizer kept updating it."""
    want = _torch_freezing()

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        out = {}
        for stage in (0, 1, 2, 3):
            m = _sf_model(stage, pl)
            out[stage] = _train_freezing(m, sf.optim.Adam(m.parameters(), lr=0.05), _sf_args(pl))
        return out
    for rank, res in enumerate(sf.launch(body, 4)):
        for stage, (losses, had, sd) in res.items():
            assert had == want[1], (stage, rank, had)
            _check((losses, sd), (want[0], want[2]), f"stage {stage} rank {rank}")


def test_freezing_between_graph_calls_is_honoured():
    """The same in a graph over a ZeRO model (``apply(zero=)`` or ``enable_zero``)."""
    losses, _, sd = _torch_freezing()

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        out = {}
        for applied, enabled in GRAPH_ZERO:
            m = _sf_model(applied, pl)
            step = _Step(m, sf.optim.Adam(m.parameters(), lr=0.05), enabled)
            params, got = dict(m.named_parameters()), []
            for s in range(STEPS):
                for name, flag in FREEZE.get(s, ()):
                    params[name].requires_grad_(flag)
                got.append(step(*_sf_args(pl)(s)).item())
            out[(applied, enabled)] = (got, m.state_dict())
        return out
    for rank, res in enumerate(sf.launch(body, 4)):
        for key, got in res.items():
            _check(got, (losses, sd), f"graph (apply zero, enable_zero) = {key} rank {rank}")


# -- copy.deepcopy (an EMA copy) ---------------------------------------------------------------
def _ema_run(model, opt, args_of, deepcopy) -> tuple:
    """``ema = deepcopy(model)``, 2 training steps of the model, each followed by the EMA
    update ``e = 0.75 e + 0.25 p``: the EMA's loss on another batch and both state dicts."""
    ema = deepcopy(model)
    for s in range(2):
        loss = model(*args_of(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.copy_(e * 0.75 + p.detach() * 0.25)
    with torch.no_grad():
        out = ema(*args_of(3)).item()
    return out, ema.state_dict(), model.state_dict()


def test_deepcopy_of_a_module_is_an_independent_copy_at_every_stage():
    """``copy.deepcopy`` of a module (a Parameter's read-only ``_view`` made it raise), laid out
    or not: the copy's parameters have the same values, layouts and placements, are new
    leaves of their own (a write to one side leaves the other), and the EMA pattern gives
    torch's values with the model at every ZeRO stage."""
    import copy
    m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
    m.load_state_dict(SD)
    want = _ema_run(m, torch.optim.SGD(m.parameters(), lr=LR), _batch, copy.deepcopy)

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        plain = sf.nn.Linear(3, 2, dtype=F64)
        twin = copy.deepcopy(plain)
        with torch.no_grad():
            twin.weight.zero_()
        alone = (plain.weight.full_tensor().abs().sum().item() > 0, type(twin.weight))
        out = {}
        for stage in (0, 1, 2, 3):
            m = _sf_model(stage, pl)
            c = copy.deepcopy(m)
            same = [(p.sbp, p.placement, q.sbp, q.placement, p is q, p.local is q.local,
                     q.requires_grad) for p, q in zip(m.parameters(), c.parameters())]
            out[stage] = (same, _ema_run(m, sf.optim.SGD(m.parameters(), lr=LR), _sf_args(pl),
                                         copy.deepcopy))
        return alone, out
    for rank, (alone, res) in enumerate(sf.launch(body, 4)):
        assert alone == (True, sf.nn.Parameter)
        for stage, (same, (loss, ema_sd, sd)) in res.items():
            for sbp, pl, csbp, cpl, is_same, shares, grad in same:
                assert (csbp, cpl, is_same, shares, grad) == (sbp, pl, False, False, True)
            _check(([loss], ema_sd), ([want[0]], want[1]), f"EMA stage {stage} rank {rank}")
            _check(([loss], sd), ([want[0]], want[2]), f"model stage {stage} rank {rank}")
