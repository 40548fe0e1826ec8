"""Optimizer state made before ZeRO takes effect, or in another dtype (docs/zero.md,
'Checkpoints'): state loaded before a graph's ``enable_zero`` applies at its first call, before
``sf.parallel.zero.shard``, or before a unit call gives a cast parameter its split update
layout, is moved to the update layout at the step, so resuming trains as the torch twin
(float64) and exactly as the run that was not interrupted; bf16 state loads into a float32
model cast to float32, as torch's ``load_state_dict`` casts it."""

import copy
import functools

import pytest
import torch

import sbpflow as sf
from sbpflow.models import mlp_class

B, S, F64 = sf.B, sf.S, torch.float64
SIZES = (10, 13, 7, 5)   # 13, 7 and 5 rows: uneven shards over 4 ranks
LR, STEPS, RESUME = 0.03, 4, 2   # the checkpoint is taken after RESUME of STEPS steps
STAGES = (1, 2, 3)


def _batch(step: int, dtype=F64) -> tuple:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, SIZES[0], generator=g, dtype=dtype), \
        torch.randint(0, SIZES[-1], (8,), generator=g)


def _cloned(sd: dict) -> dict:
    return {k: v.detach().clone() for k, v in sd.items()}


@functools.cache
def _reference() -> tuple:
    """The torch twin (one device, float64, single-tensor AdamW; never inside sf.launch): the
    initial weights, (weights, optimizer state dict) at the resume point, the final weights."""
    torch.manual_seed(0)
    m = mlp_class(torch.nn, torch.nn.functional)(SIZES).double()
    sd0 = _cloned(m.state_dict())
    opt = torch.optim.AdamW(m.parameters(), lr=LR, foreach=False)
    mid = None
    for s in range(STEPS):
        if s == RESUME:
            mid = (_cloned(m.state_dict()), copy.deepcopy(opt.state_dict()))
        x, y = _batch(s)
        m(x, y).backward()
        opt.step()
        opt.zero_grad()
    return sd0, mid, _cloned(m.state_dict())


class _Step(sf.nn.Graph):
    def __init__(self, m, opt, stage: int) -> None:
        super().__init__()
        self.m = m
        self.add_optimizer(opt)
        self.config.enable_zero(stage)

    def build(self, x, y):
        loss = self.m(x, y)
        loss.backward()
        return loss


def _model(pl, sd: dict | None, zero: int = 0, seed: int = 5):
    sf.manual_seed(seed)
    m = mlp_class(sf.nn, sf.nn.functional)(SIZES).double()
    if sd is not None:
        m.load_state_dict(sd)
    sf.parallel.apply(m, pl, {"*": B}, zero=zero)
    return m


def _train(m, opt, pl, start: int, stop: int = STEPS, graph=None) -> dict:
    """Steps ``start`` .. ``stop`` - 1 (eagerly, or by calling ``graph``); the weights."""
    for s in range(start, stop):
        x, y = (sf.tensor(t, pl, S(0)) for t in _batch(s))
        if graph is not None:
            graph(x, y)
        else:
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
    return m.state_dict()


# -- Z4: state that exists before ZeRO takes effect ----------------------------------------------
def _graph_load_state_dict(pl, path: str, stage: int, mid: dict, osd: dict):
    """torch's state dict loaded before the graph's first call, which applies
    ``enable_zero``; its groups say ``foreach=False``: the one-at-a-time update."""
    m = _model(pl, mid)
    opt = sf.optim.AdamW(m.parameters(), lr=LR)
    opt.load_state_dict(osd)
    return _train(m, opt, pl, RESUME, graph=_Step(m, opt, stage)), opt, m


def _graph_sf_load(pl, path: str, stage: int, mid: dict, osd: dict):
    """``sf.load`` before the graph's first call (the fused update)."""
    m = _model(pl, None)
    opt = sf.optim.AdamW(m.parameters(), lr=LR)
    graph = _Step(m, opt, stage)
    start = sf.load(path, m, opt)
    return _train(m, opt, pl, start, graph=graph), opt, m


def _shard_after_load(pl, path: str, stage: int, mid: dict, osd: dict):
    """``sf.parallel.zero.shard`` after ``load_state_dict``, before the first step (the
    multi-tensor update)."""
    m = _model(pl, mid)
    opt = sf.optim.AdamW(m.parameters(), lr=LR)
    opt.load_state_dict(osd)
    opt.param_groups[0].update(foreach=True, fused=False)
    sf.parallel.zero.shard(m, stage)
    return _train(m, opt, pl, RESUME), opt, m


def _cast_then_load(pl, path: str, stage: int, mid: dict, osd: dict):
    """``apply(zero=stage)`` on a float32 model, ``.double()`` (new parameters: the next unit
    call gives them their split update layout), a new optimizer, ``sf.load``."""
    sf.manual_seed(5)
    m = mlp_class(sf.nn, sf.nn.functional)(SIZES)
    sf.parallel.apply(m, pl, {"*": B}, zero=stage)
    m.double()
    opt = sf.optim.AdamW(m.parameters(), lr=LR)
    start = sf.load(path, m, opt)
    return _train(m, opt, pl, start), opt, m


FROM_CHECKPOINT = ("graph-sf.load", "cast-then-load")
ROUTES = {"graph-load_state_dict": _graph_load_state_dict, "graph-sf.load": _graph_sf_load,
          "shard-after-load": _shard_after_load, "cast-then-load": _cast_then_load}


def _baseline(path: str, sd0: dict) -> dict:
    """The uninterrupted eager ZeRO run of each stage (its weights), which saves the
    checkpoint its stage resumes from (``{path}-{stage}``) at the resume point.

    Not one data-parallel run's checkpoint for all stages: torch's fused AdamW kernel, in a
    CPU build with FMA (capability AVX2 or AVX512), rounds ``exp_avg_sq * beta2 + (1 - beta2)
    * grad * grad`` one way in its vector loop and another in its scalar tail (a different
    product fused into the multiply-add), so an element's last bit depends on where it lies
    in the tensor the kernel is given: the whole parameter in data parallel, the rank's shard
    in ZeRO. From the second step on the two runs differ by an ulp, and a resume from data
    parallel's state with them. ``sf.load`` fills the loading model's layouts, whichever run
    wrote the file, so the routes' state still lands whole and is moved at the step."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    out = {}
    for stage in STAGES:
        m = _model(pl, sd0, zero=stage)
        opt = sf.optim.AdamW(m.parameters(), lr=LR)
        _train(m, opt, pl, 0, RESUME)
        sf.save(f"{path}-{stage}", m, opt, step=RESUME)
        out[stage] = _train(m, opt, pl, RESUME)
    return out


def _resumed(route: str, path: str, mid: dict, osd: dict) -> dict:
    """``route``'s resumed run at each stage: (weights, this rank's exp_avg shard shape of
    the first weight)."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    out = {}
    for stage in STAGES:
        sd, opt, m = ROUTES[route](pl, f"{path}-{stage}", stage, mid, osd)
        out[stage] = (sd, tuple(opt.state[m.net[0].weight]["exp_avg"].local.shape))
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    sd0, mid, want = _reference()
    path = str(tmp_path_factory.mktemp("zero_resume") / "ckpt")
    return path, sf.launch(_baseline, 4, args=(path, sd0))[0], mid, want


@pytest.mark.parametrize("route", list(ROUTES))
def test_state_loaded_before_zero_takes_effect_is_resharded(baseline, route):
    """Each route trains as the torch twin and as the uninterrupted eager ZeRO run, and keeps
    the state split (before: weights off by 0.21, or a shape error in the one-at-a-time
    update; the state whole)."""
    path, base, (mid, osd), want = baseline
    res = sf.launch(_resumed, 4, args=(route, path, mid, osd))
    # resumed from the uninterrupted run's checkpoint: bit for bit; from torch's state dict
    # (its first steps rounded by torch's kernel): to float64 rounding
    tol = 0.0 if route in FROM_CHECKPOINT else 1e-12
    for rank, r in enumerate(res):
        for stage in STAGES:
            sd, shape = r[stage]
            for k, v in want.items():
                torch.testing.assert_close(sd[k], v, rtol=0, atol=1e-12,
                                           msg=lambda s: f"{route} stage {stage} {k}: {s}")
                torch.testing.assert_close(sd[k], base[stage][k], rtol=0, atol=tol,
                                           msg=lambda s: f"{route} stage {stage} {k} vs "
                                                         f"uninterrupted: {s}")
            # 13 x 10 weight, rows split 4, 3, 3, 3
            assert shape == ((4 if rank == 0 else 3), 10), (route, stage, rank, shape)


# -- Z6: optimizer state of another dtype --------------------------------------------------------
_X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


@functools.cache
def _bf16_reference() -> tuple:
    """torch: a bf16 Linear's AdamW state after one step, and the float32 twin that loads it
    (torch casts it to float32) and steps once: (float32 weights, state dict, weights after)."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 4)
    w0 = _cloned(lin.state_dict())
    half = copy.deepcopy(lin).bfloat16()
    opt = torch.optim.AdamW(half.parameters(), lr=0.01)
    half(_X.bfloat16()).pow(2).sum().backward()
    opt.step()
    osd = copy.deepcopy(opt.state_dict())
    return w0, osd, _torch_step(w0, osd)


def _torch_step(w0: dict, osd: dict) -> dict:
    """A float32 torch Linear with weights ``w0`` and AdamW state ``osd["state"]`` (cast by
    torch's load_state_dict), after one step on ``_X``."""
    lin = torch.nn.Linear(8, 4)
    lin.load_state_dict(w0)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.01, foreach=False)
    # (a copy: torch keeps the loaded "step" tensors and counts them up in place)
    opt.load_state_dict({"state": copy.deepcopy(osd["state"]),
                         "param_groups": opt.state_dict()["param_groups"]})
    assert {v["exp_avg"].dtype for v in opt.state.values()} == {torch.float32}
    lin(_X).pow(2).sum().backward()
    opt.step()
    return _cloned(lin.state_dict())


def _load_bf16_state(w0: dict, osd: dict) -> dict:
    """At stages 0 and 1: a float32 Linear loads ``osd`` (bf16) and steps once."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    out = {}
    for stage in (0, 1):
        m = sf.nn.Linear(8, 4)
        m.load_state_dict(w0)
        sf.parallel.apply(m, pl, {"*": B}, zero=stage)
        opt = sf.optim.AdamW(m.parameters(), lr=0.01)
        opt.load_state_dict(osd)
        loaded = {v["exp_avg"].dtype for v in opt.state.values()}
        m(sf.tensor(_X, pl, S(0))).pow(2).sum().backward()
        opt.step()
        out[stage] = (loaded, m.state_dict())
    return out


def test_a_bf16_state_dict_loads_into_float32_as_torch():
    """``load_state_dict`` of a bf16 torch state dict casts it to the float32 parameters'
    dtype, as torch does, and the step is torch's (before: the fused kernel raised
    'expected scalar type Float but found BFloat16')."""
    w0, osd, want = _bf16_reference()
    res = sf.launch(_load_bf16_state, 4, args=(w0, osd))
    for r in res:
        for stage, (loaded, sd) in r.items():
            assert loaded == {torch.float32}, (stage, loaded)
            for k, v in want.items():
                torch.testing.assert_close(sd[k], v, rtol=0, atol=1e-6,
                                           msg=lambda s: f"stage {stage} {k}: {s}")


def _bf16_checkpoint(path: str) -> None:
    """A bf16 Linear trained one step with ZeRO-3, saved."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    sf.manual_seed(1)
    m = sf.nn.Linear(8, 4).to(torch.bfloat16)
    sf.parallel.apply(m, pl, {"*": B}, zero=3)
    opt = sf.optim.AdamW(m.parameters(), lr=0.01)
    m(sf.tensor(_X.bfloat16(), pl, S(0))).pow(2).sum().backward()
    opt.step()
    sf.save(path, m, opt, step=1)


def _resume_in_float32(path: str) -> tuple:
    """The checkpoint loaded into a float32 ZeRO-1 Linear: (weights and optimizer state dict
    as loaded, weights and exp_avg dtypes after one step)."""
    pl = sf.placement("cpu", [0, 1, 2, 3])
    sf.manual_seed(2)
    m = sf.nn.Linear(8, 4)
    sf.parallel.apply(m, pl, {"*": B}, zero=1)
    opt = sf.optim.AdamW(m.parameters(), lr=0.01)
    sf.load(path, m, opt)
    loaded = (m.state_dict(), opt.state_dict())
    m(sf.tensor(_X, pl, S(0))).pow(2).sum().backward()
    opt.step()
    return loaded, m.state_dict(), {v["exp_avg"].dtype for v in opt.state.values()}


def test_a_bf16_checkpoint_resumes_in_float32(tmp_path):
    """bf16 ZeRO-3 -> ``sf.save`` -> float32 ZeRO-1 -> ``sf.load`` -> a step: the state is
    float32 and the step is the torch twin's from the loaded values (before: the fused kernel
    raised 'expected scalar type Float but found BFloat16')."""
    path = str(tmp_path / "bf16")
    sf.launch(_bf16_checkpoint, 4, args=(path,))
    res = sf.launch(_resume_in_float32, 4, args=(path,))
    (w0, osd), _, _ = res[0]
    want = _torch_step(w0, osd)   # outside sf.launch
    for _, sd, dtypes in res:
        assert dtypes == {torch.float32}, dtypes
        for k, v in want.items():
            torch.testing.assert_close(sd[k], v, rtol=0, atol=1e-6, msg=lambda s: f"{k}: {s}")
