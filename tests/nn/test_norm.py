"""Normalisation layers against torch on one device (float64): BatchNorm1d / 2d over the logical
batch in every layout (outputs, gradients, running statistics over several steps, eval), their
communication, GroupNorm, RMSNorm, errors, and a small ResNet trained data-parallel."""

import pytest
import torch

import sbpflow as sf

F64 = torch.float64


def _rand(*shape, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=F64, generator=g) * scale + shift


def _close(got, want, what: str, rtol: float = 1e-9, atol: float = 1e-11) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# -- BatchNorm: every layout equals torch, step by step ---------------------------------------------
# name -> (world, mesh ranks, input nd-sbp, parameter nd-sbp, input shape)
BN_LAYOUTS = {
    "dp-uneven": (4, [0, 1, 2, 3], sf.S(0), sf.B, (6, 5, 3, 3)),        # 2, 2, 1, 1 samples
    "dp-empty-shard": (4, [0, 1, 2, 3], sf.S(0), sf.B, (3, 5, 2, 2)),   # rank 3 holds none
    "channels": (4, [0, 1, 2, 3], sf.S(1), sf.S(0), (6, 5, 3, 3)),      # 2, 1, 1, 1 channels
    "channels-weight-B": (2, [0, 1], sf.S(1), sf.B, (4, 5, 3, 3)),
    "replicated": (2, [0, 1], sf.B, sf.B, (4, 5, 3, 3)),
    "spatial": (2, [0, 1], sf.S(2), sf.B, (4, 5, 3, 3)),
    "2d-mesh": (4, [[0, 1], [2, 3]], (sf.S(0), sf.S(1)), (sf.B, sf.S(0)), (6, 5, 3, 3)),
}
STEPS = 3


def _bn_run(pl, x_sbp, w_sbp, shape, module_kwargs: dict, dims: int = 4):
    """Inside a rank: STEPS training steps of a BatchNorm (weight / bias set to known values)
    with a gradient seed; returns per-step (y, x.grad), the parameter gradients, the state
    dict and the eval output."""
    cls = sf.nn.BatchNorm2d if dims == 4 else sf.nn.BatchNorm1d
    bn = cls(shape[1], dtype=F64, **module_kwargs)
    if bn.affine:
        bn.load_state_dict({"weight": _rand(shape[1], seed=1), "bias": _rand(shape[1], seed=2)},
                           strict=False)
        sf.parallel.apply(bn, pl, {"*": w_sbp})
    steps = []
    for step in range(STEPS):
        x = sf.tensor(_rand(*shape, seed=10 + step, scale=2.0, shift=3.0), pl,
                      x_sbp).requires_grad_()
        y = bn(x)
        (y * sf.tensor(_rand(*shape, seed=20 + step), pl, x_sbp)).sum().backward()
        steps.append((y.full_tensor(), x.grad.full_tensor()))
    grads = {n: p.grad.full_tensor() for n, p in bn.named_parameters()}
    bn.eval()
    y_eval = bn(sf.tensor(_rand(*shape, seed=30), pl, x_sbp)).full_tensor()
    return steps, grads, bn.state_dict(), y_eval


def _bn_reference(shape, module_kwargs: dict, dims: int = 4):
    cls = torch.nn.BatchNorm2d if dims == 4 else torch.nn.BatchNorm1d
    bn = cls(shape[1], dtype=F64, **module_kwargs)
    if bn.affine:
        with torch.no_grad():
            bn.weight.copy_(_rand(shape[1], seed=1))
            bn.bias.copy_(_rand(shape[1], seed=2))
    steps = []
    for step in range(STEPS):
        x = _rand(*shape, seed=10 + step, scale=2.0, shift=3.0).requires_grad_()
        y = bn(x)
        (y * _rand(*shape, seed=20 + step)).sum().backward()
        steps.append((y.detach(), x.grad))
    grads = {n: p.grad for n, p in bn.named_parameters()}
    bn.eval()
    return steps, grads, bn.state_dict(), bn(_rand(*shape, seed=30)).detach()


def _compare_bn(got, want) -> None:
    (steps, grads, state, y_eval), (r_steps, r_grads, r_state, r_eval) = got, want
    for i, ((y, gx), (ry, rgx)) in enumerate(zip(steps, r_steps)):
        _close(y, ry, f"output, step {i}")
        _close(gx, rgx, f"input gradient, step {i}")
    assert grads.keys() == r_grads.keys()
    for name in grads:
        _close(grads[name], r_grads[name], f"{name} gradient")
    assert list(state) == list(r_state)  # torch's keys, in torch's order
    for key in state:
        _close(state[key], r_state[key], key, rtol=1e-12, atol=1e-14)
    _close(y_eval, r_eval, "eval output")


@pytest.mark.parametrize("name", list(BN_LAYOUTS))
def test_batch_norm_2d_equals_torch_in_every_layout(name):
    world, ranks, x_sbp, w_sbp, shape = BN_LAYOUTS[name]

    def body():
        return _bn_run(sf.placement("cpu", ranks), x_sbp, w_sbp, shape, {})

    _compare_bn(sf.launch(body, world_size=world)[0], _bn_reference(shape, {}))


@pytest.mark.parametrize("kwargs,shape", [
    ({"momentum": None}, (6, 5, 3, 3)),                        # cumulative average
    ({"affine": False}, (6, 5, 3, 3)),
    ({"track_running_stats": False}, (6, 5, 3, 3)),           # eval uses batch statistics
    ({"momentum": 0.3, "eps": 1e-3}, (6, 5)),                  # BatchNorm1d, (N, C)
    ({}, (6, 5, 4)),                                           # BatchNorm1d, (N, C, L)
])
def test_batch_norm_options_equal_torch_data_parallel(kwargs, shape):
    dims = len(shape) if len(shape) == 4 else 1

    def body():
        return _bn_run(sf.placement("cpu", [0, 1, 2, 3]), sf.S(0), sf.B, shape, kwargs, dims)

    _compare_bn(sf.launch(body, world_size=4)[0], _bn_reference(shape, kwargs, dims))


def test_batch_norm_communication_per_layout():
    """Batch split: one all-reduce of the (2, C) float64 sums forward and one backward (the
    weight's gradient is left partial for the optimizer); channel split: nothing."""
    c = 6

    def body(x_sbp):
        pl = sf.placement("cpu", [0, 1, 2, 3])
        bn = sf.nn.BatchNorm2d(c, dtype=torch.float32)
        x = sf.tensor(_rand(8, c, 4, 4, seed=0).float(), pl, x_sbp).requires_grad_()
        bn(x)  # the buffers move beside the input once
        sf.comm.reset_stats()
        y = bn(x)
        fwd = sf.comm.stats().copy()
        sf.comm.reset_stats()
        y.sum().backward()
        return fwd, sf.comm.stats()

    fwd, bwd = sf.launch(body, world_size=4, args=(sf.S(0),))[0]
    ring = 2 * 3 * (2 * c * 8) // 4  # a ring all-reduce of 2C float64 over 4 ranks, sent
    for stats in (fwd, bwd):
        assert stats["all_reduce"].calls == 1 and stats.sent == stats["all_reduce"].sent == ring
    fwd, bwd = sf.launch(body, world_size=4, args=(sf.S(1),))[0]
    assert fwd.sent == fwd.recv == bwd.sent == bwd.recv == 0


def test_batch_norm_float32_statistics_far_from_zero():
    """float32 inputs with mean / std = 1000: the ranks' sums are combined in float64, so the
    variance keeps its digits (float32 sums were off by 6%: outputs off by 0.3)."""
    xs = [_rand(16, 4, 4, 4, seed=s, shift=1000.0).float() for s in range(2)]

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        bn = sf.nn.BatchNorm2d(4)
        return [bn(sf.tensor(x, pl, sf.S(0))).full_tensor() for x in xs], bn.state_dict()

    outs, state = sf.launch(body, world_size=4)[0]
    ref = torch.nn.BatchNorm2d(4, dtype=F64)   # the float64 truth
    for y, x in zip(outs, xs):
        torch.testing.assert_close(y, ref(x.double()).float(), rtol=0, atol=3e-4)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value.to(state[key].dtype), rtol=1e-5, atol=1e-4)


# -- GroupNorm and RMSNorm ----------------------------------------------------------------------
@pytest.mark.parametrize("groups,ranks,x_sbp,w_sbp", [
    (3, [0, 1, 2, 3], sf.S(0), sf.B),
    (3, [0, 1, 2], sf.S(1), sf.S(0)),                   # one group a rank
    (3, [0, 1, 2, 3], sf.S(1), sf.S(0)),                # 2, 2, 1, 1 channels: not whole groups
    (6, [0, 1, 2, 3], sf.S(1), sf.B),                   # whole groups of one channel
    (2, [[0, 1], [2, 3]], (sf.S(0), sf.S(1)), (sf.B, sf.S(0))),
])
def test_group_norm_equals_torch(groups, ranks, x_sbp, w_sbp):
    shape = (5, 6, 3, 2)
    w, b = _rand(6, seed=1), _rand(6, seed=2)

    def body():
        pl = sf.placement("cpu", ranks)
        gn = sf.nn.GroupNorm(groups, 6, dtype=F64)
        gn.load_state_dict({"weight": w, "bias": b})
        sf.parallel.apply(gn, pl, {"*": w_sbp})
        x = sf.tensor(_rand(*shape, seed=3), pl, x_sbp).requires_grad_()
        y = gn(x)
        (y * sf.tensor(_rand(*shape, seed=4), pl, x_sbp)).sum().backward()
        return y.full_tensor(), x.grad.full_tensor(), gn.weight.grad.full_tensor(), \
            gn.bias.grad.full_tensor()

    got = sf.launch(body, world_size=4)[0]
    x, wr, br = (_rand(*shape, seed=3).requires_grad_(), w.clone().requires_grad_(),
                 b.clone().requires_grad_())
    y = torch.nn.functional.group_norm(x, groups, wr, br)
    (y * _rand(*shape, seed=4)).sum().backward()
    for g, r, what in zip(got, (y.detach(), x.grad, wr.grad, br.grad), ("y", "dx", "dw", "db")):
        _close(g, r, what)


@pytest.mark.parametrize("x_sbp,w_sbp,eps,affine", [
    (sf.S(0), sf.B, None, True),
    (sf.S(2), sf.S(0), None, True),      # the normalised axis split: one all-reduce
    (sf.S(2), sf.B, 1e-3, True),
    (sf.S(1), sf.B, 0.1, False),
    (sf.B, sf.B, None, False),
])
def test_rms_norm_equals_torch(x_sbp, w_sbp, eps, affine):
    shape = (3, 4, 8)
    w = _rand(8, seed=1)

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        m = sf.nn.RMSNorm(8, eps=eps, elementwise_affine=affine, dtype=F64)
        if affine:
            m.load_state_dict({"weight": w})
            sf.parallel.apply(m, pl, {"*": w_sbp})
        x = sf.tensor(_rand(*shape, seed=2), pl, x_sbp).requires_grad_()
        y = m(x)
        (y * sf.tensor(_rand(*shape, seed=3), pl, x_sbp)).sum().backward()
        return y.full_tensor(), x.grad.full_tensor(), \
            m.weight.grad.full_tensor() if affine else None

    y, gx, gw = sf.launch(body, world_size=4)[0]
    x, wr = _rand(*shape, seed=2).requires_grad_(), w.clone().requires_grad_()
    ref = torch.nn.functional.rms_norm(x, (8,), wr if affine else None, eps)
    (ref * _rand(*shape, seed=3)).sum().backward()
    _close(y, ref.detach(), "y")
    _close(gx, x.grad, "dx")
    if affine:
        _close(gw, wr.grad, "dw")


# -- errors ---------------------------------------------------------------------------------------
def test_normalisation_errors_name_the_problem():
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.tensor(_rand(4, 3, 2, 2, seed=0), pl, sf.S(0))
        errors = {}
        for key, call in {
            "dims": lambda: sf.nn.BatchNorm1d(3, dtype=F64)(x),
            "one value": lambda: sf.nn.BatchNorm1d(3, dtype=F64)(
                sf.tensor(_rand(1, 3, seed=0), pl, sf.B)),
            "placement": lambda: sf.nn.functional.batch_norm(
                x, sf.zeros(3, placement=sf.placement("cpu", [0]), dtype=F64),
                sf.ones(3, placement=sf.placement("cpu", [0]), dtype=F64), training=True),
            "channels": lambda: sf.nn.functional.batch_norm(
                x, sf.zeros(4, placement=pl, dtype=F64), sf.ones(4, placement=pl, dtype=F64)),
            "groups": lambda: sf.nn.functional.group_norm(x, 2),
            "rms shape": lambda: sf.nn.functional.rms_norm(x, (3,)),
        }.items():
            with pytest.raises(Exception) as info:
                call()
            errors[key] = (type(info.value), str(info.value))
        return errors

    errors = sf.launch(body, world_size=2)[0]
    assert issubclass(errors["dims"][0], sf.ShapeError) and "expected 2D or 3D input (got 4D" \
        in errors["dims"][1]
    assert errors["one value"][0] is ValueError and "more than 1 value per channel" in \
        errors["one value"][1]
    assert issubclass(errors["placement"][0], sf.errors.PlacementMismatchError) and \
        "to_global" in errors["placement"][1]
    assert issubclass(errors["channels"][0], sf.ShapeError) and "(3,)" in errors["channels"][1]
    assert issubclass(errors["groups"][0], sf.ShapeError) and "num_groups 2" in \
        errors["groups"][1]
    assert issubclass(errors["rms shape"][0], sf.ShapeError) and "(3,)" in \
        errors["rms shape"][1]


# -- a small ResNet trained data-parallel ---------------------------------------------------------
def _resnet(nn, dtype=None):
    """conv-BN-ReLU, one residual block (conv-BN-ReLU-conv-BN, + identity, ReLU), pooling and a
    linear head, written once for sf.nn and torch.nn."""
    kw = {"dtype": dtype} if dtype is not None else {}

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False, **kw)
            self.bn1 = nn.BatchNorm2d(c, **kw)
            self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False, **kw)
            self.bn2 = nn.BatchNorm2d(c, **kw)
            self.relu = nn.ReLU()

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv2(out)) + x)

    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False, **kw), nn.BatchNorm2d(4, **kw),
                         nn.ReLU(), Block(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3, **kw))


def test_small_resnet_trains_data_parallel_as_torch():
    batches = [(_rand(6, 3, 6, 6, seed=40 + s),
                torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(50 + s)))
               for s in range(3)]

    def body():
        sf.manual_seed(0)
        model = _resnet(sf.nn, F64)
        init = model.state_dict()
        pl = sf.placement("cpu", [0, 1, 2, 3])
        sf.parallel.apply(model, pl, {"*": sf.B})
        opt = sf.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = sf.nn.functional.cross_entropy(model(sf.tensor(x, pl, sf.S(0))),
                                                  sf.tensor(y, pl, sf.S(0)))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        y_eval = model(sf.tensor(batches[0][0], pl, sf.S(0))).full_tensor()
        return init, losses, model.state_dict(), y_eval

    init, losses, state, y_eval = sf.launch(body, world_size=4)[0]
    ref = _resnet(torch.nn).to(F64)
    ref.load_state_dict(init)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    _close(torch.tensor(losses), torch.tensor(ref_losses), "losses")
    assert list(state) == list(ref.state_dict())
    for key, value in ref.state_dict().items():
        _close(state[key], value, key)
    ref.eval()
    _close(y_eval, ref(batches[0][0]).detach(), "eval output")


class _Step(sf.nn.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = sf.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def test_graph_mode_updates_running_statistics_as_eager():
    """The update is an op that the normalisation reads, so a graph replays it on every call
    (and the trace's own run does not count the first batch twice)."""
    batches = [(_rand(8, 3, 6, 6, seed=60 + s),
                torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(70 + s)))
               for s in range(3)]

    def body(graph):
        sf.manual_seed(0)
        model = _resnet(sf.nn, F64)
        for m in model.modules():
            if isinstance(m, sf.nn.BatchNorm2d):
                m.momentum = None   # the factor comes from num_batches_tracked at each replay
        pl = sf.placement("cpu", [0, 1, 2, 3])
        sf.parallel.apply(model, pl, {"*": sf.B})
        opt = sf.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = _Step(model, opt)
        losses = []
        for x, y in batches:
            x, y = sf.tensor(x, pl, sf.S(0)), sf.tensor(y, pl, sf.S(0))
            if graph:
                loss = step(x, y)
            else:
                opt.zero_grad()
                loss = sf.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            losses.append(loss.to_global(pl, sf.B).local.item())
        return losses, model.state_dict()

    (eager_losses, eager), (graph_losses, graph) = (sf.launch(body, world_size=4, args=(g,))[0]
                                                    for g in (False, True))
    _close(torch.tensor(graph_losses), torch.tensor(eager_losses), "losses")
    assert int(graph["1.num_batches_tracked"]) == 3
    for key, value in eager.items():
        _close(graph[key], value, key)
