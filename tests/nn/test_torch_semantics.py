"""Torch semantics a torch user relies on without thinking, on global tensors, against plain torch
on one device (float64): ``==`` is elementwise (and tensors still work as dict keys); ``max`` /
``min`` / ``sort`` / ``topk`` / ... return torch's (values, indices); an in-place op on a view
writes through to the tensor it views, a view reads its base's new value, and item assignment
works. Then two user programs: a torchvision-style ResNet-18 trained data parallel, and a plain
torch MLP written with ``torch.nn.functional`` (eval, no_grad, apply, to, buffers)."""

import copy
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sbpflow as sf

F64 = torch.float64
LAYOUTS = [sf.S(0), sf.S(1), sf.S(2), sf.B, sf.P]


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


X = _rand(4, 6, 8, seed=0)
X[0, 0, :3] = X[0, 0, 3]           # ties, for mode
W = _rand(4, 6, 8, seed=1)


def _value(v):
    """A result with its structure: named tuples keep their type name; global tensors become
    their logical value."""
    if isinstance(v, tuple):
        return type(v).__name__, tuple(_value(t) for t in v)
    return v.full_tensor() if isinstance(v, sf.GlobalTensor) else v


def _same(got, want) -> bool:
    if isinstance(want, tuple):
        return got[0] == type(want).__name__ and len(got[1]) == len(want) and \
            all(_same(g, w) for g, w in zip(got[1], want))
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and \
            got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    return got == want


def _bad_cases(cases: dict, world: int = 2) -> list:
    """The cases (name -> fn(x)) whose result on X laid out in each of `LAYOUTS` differs from
    torch's on X: (name, layout, what it gave)."""
    def body():
        pl = sf.placement("cpu", list(range(world)))
        bad = []
        for sbp in LAYOUTS:
            for name, fn in cases.items():
                try:
                    got = _value(fn(sf.tensor(X, pl, sbp)))
                except Exception as exc:  # noqa: BLE001 - reported with the case
                    got = repr(exc)
                if not _same(got, fn(X.clone())):
                    bad.append((name, sbp, got))
        return bad
    return sf.launch(body, world_size=world)[0]


# -- 1. comparisons -----------------------------------------------------------------------------
COMPARISONS = {
    "eq": lambda x: x == x * 1.0,
    "ne": lambda x: x != x.clamp(min=0),
    "eq_self_nan_free": lambda x: x == x,
    "eq_number": lambda x: x.round() == 0,
    "ne_plain": lambda x: x != torch.zeros(8, dtype=F64),
    "plain_eq": lambda x: torch.zeros(8, dtype=F64) == x.clamp(min=0),
    "lt_gt": lambda x: (x < 0.5) & (x >= -0.5),
    "eq_none": lambda x: (x == None, x != None),  # noqa: E711 - torch's answer: identity
    "contains": lambda x: (bool(X[1, 2, 3].item() in x), 123.0 in x),
    "iterate": lambda x: [row.sum() for row in x][2],
}


def test_comparisons_are_elementwise_and_tensors_still_dict_keys():
    assert _bad_cases(COMPARISONS) == []

    def body():
        pl = sf.placement("cpu", [0, 1])
        a, b = sf.tensor(X, pl, sf.S(0)), sf.tensor(X, pl, sf.S(0))
        weak, weak_set = weakref.WeakKeyDictionary(), weakref.WeakSet()
        weak[a], weak[b] = 1, 2
        weak[a] = 3
        weak_set.add(a)
        weak_set.add(a)
        found = (weak[a], weak[b], a in weak, len(weak), a in weak_set, b in weak_set)
        plain = {a: "a", b: "b"}
        same = (plain[a], plain[b], a in [a], a in {a}, {a, b} == {b, a})
        del weak[a]
        return found, same, len(weak)
    found, same, left = sf.launch(body, world_size=2)[0]
    assert found == (3, 2, True, 2, True, False)      # keys by identity, as torch tensors
    assert same == ("a", "b", True, True, True) and left == 1


def _ints(x):
    """Integers and a mask derived from X (any layout): the operands of the bitwise cases."""
    return (x * 4).round().long(), x > 0


BITWISE = {   # torch's operators: bitwise on integers, logical on bools, torch's type promotion
    "and_long_bool": lambda x: _ints(x)[0] & _ints(x)[1],
    "bool_and_long": lambda x: _ints(x)[1] & _ints(x)[0],
    "or_xor": lambda x: (_ints(x)[0] | (_ints(x)[0] + 1), _ints(x)[0] ^ 3, _ints(x)[1] ^ True),
    "reflected": lambda x: (3 ^ _ints(x)[0], 5 | _ints(x)[0], 6 & _ints(x)[0], True & _ints(x)[1],
                            1 << _ints(x)[0].abs().clamp(max=5),
                            64 >> _ints(x)[0].abs().clamp(max=5)),
    "invert": lambda x: (~_ints(x)[0], ~_ints(x)[1], _ints(x)[0].bitwise_not()),
    "shifts": lambda x: (_ints(x)[0].abs() << 2, _ints(x)[0] >> 1,
                         _ints(x)[0] << _ints(x)[1].long()),
    "generate_unfinished": lambda x: _ints(x)[0].clamp(0, 1) & ~_ints(x)[1],
    "masks": lambda x: ((x > 0) & (x < 1)) | ~(x > -1),
    "in_place": lambda x: _in_place_bitwise(*_ints(x)),
    "in_place_refused": lambda x: _in_place_refused(*_ints(x)),
}


def _in_place_bitwise(i, m):
    j = i.clone()
    j &= m
    j |= 4
    j ^= i
    j <<= 1
    j >>= 1
    k = m.clone()
    k |= m.logical_not()
    k ^= True
    return j, k


def _in_place_refused(i, m):
    try:
        m &= i
    except RuntimeError as exc:   # torch: a Long result cannot be written into a Bool tensor
        return "can't be cast" in str(exc)
    return "written"


def _same_exactly(got, want) -> bool:
    if isinstance(want, tuple):
        return len(got[1]) == len(want) and all(_same_exactly(g, w) for g, w in zip(got[1], want))
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    return got == want


def test_bitwise_operators_as_torch():
    def body():
        pl = sf.placement("cpu", [0, 1])
        bad = []
        for sbp in (sf.S(0), sf.S(2), sf.P):
            for name, fn in BITWISE.items():
                try:
                    got = _value(fn(sf.tensor(X, pl, sbp)))
                except Exception as exc:  # noqa: BLE001 - reported with the case
                    got = repr(exc)
                if not _same_exactly(got, fn(X.clone())):
                    bad.append((name, sbp, got))
        return bad
    assert sf.launch(body, world_size=2)[0] == []


# -- 2. values and indices -----------------------------------------------------------------------
SELECTIONS = {
    "max_dim": lambda x: x.max(1),
    "max_dim_indexed": lambda x: (x.max(-1)[0], x.max(-1)[1], x.max(dim=0).indices),
    "max_keepdim": lambda x: x.max(dim=-1, keepdim=True),
    "torch_max_dim": lambda x: torch.max(x, 2),
    "torch_max_other": lambda x: torch.max(x, x * 0.5),
    "max_other": lambda x: x.max(x * 0.5),
    "max_all": lambda x: (x.max(), torch.max(x), x.min(), torch.min(x)),
    "min_dim": lambda x: x.min(0),
    "torch_min_dim": lambda x: torch.min(x, dim=1, keepdim=True),
    "sort": lambda x: x.sort(1),
    "sort_descending": lambda x: torch.sort(x, dim=-1, descending=True, stable=True),
    "argsort": lambda x: (x.argsort(1), torch.argsort(x, dim=0, descending=True)),
    "topk": lambda x: x.topk(3),
    "topk_smallest": lambda x: torch.topk(x, 2, dim=0, largest=False),
    "kthvalue": lambda x: x.kthvalue(2, 1),
    "median": lambda x: (x.median(), torch.median(x)),
    "median_dim": lambda x: x.median(2, keepdim=True),
    "mode": lambda x: x.round().mode(1),
    "argmax": lambda x: (x.argmax(), torch.argmax(x, 1), x.argmin(dim=2, keepdim=True)),
    "aminmax": lambda x: (torch.aminmax(x), x.aminmax(dim=1)),
    "var_std": lambda x: (x.var(), x.var(1, keepdim=True), torch.var(x, dim=(0, 2), correction=0),
                          x.var(1, False), x.std(2), torch.std(x)),
    "var_mean": lambda x: (torch.std_mean(x, 1), torch.var_mean(x, dim=2, keepdim=True)),
}


def test_values_and_indices_as_torch():
    assert _bad_cases(SELECTIONS) == []


def test_values_carry_gradients_and_indices_none():
    def run(x, w):
        values, indices = x.max(1)
        top, _ = torch.topk(x * w, 2, dim=-1)
        ordered = x.sort(dim=0, descending=True).values
        spread, mean = torch.std_mean(x * w, dim=2)
        loss = (values * values).sum() + top.sum() + (ordered[0] * w[0]).sum() + \
            spread.sum() + mean.sum() + x.median(2).values.sum()
        return loss, indices

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        x = sf.tensor(X, pl, sf.S(1)).requires_grad_()
        w = sf.tensor(W, pl, sf.S(2)).requires_grad_()
        loss, indices = run(x, w)
        loss.backward()
        return (loss.item(), indices.full_tensor(), indices.requires_grad, x.grad.full_tensor(),
                w.grad.full_tensor())
    got = sf.launch(body, world_size=4)[0]
    x, w = X.clone().requires_grad_(), W.clone().requires_grad_()
    loss, indices = run(x, w)
    loss.backward()
    assert got[0] == pytest.approx(loss.item(), rel=1e-12)
    assert torch.equal(got[1], indices) and got[2] is False
    torch.testing.assert_close(got[3], x.grad)
    torch.testing.assert_close(got[4], w.grad)


# -- 3. views and in-place ops -------------------------------------------------------------------
def _writes_through_views(x):
    y = x.clone()
    y[:, 0].zero_()                       # an in-place op on a slice
    y.view(4, 48).mul_(2)                 # on a reshape
    y.transpose(1, 2)[0, 0].fill_(-1)     # on a slice of a transpose
    _, right = y.split(3, dim=1)
    right.add_(10)                        # on a piece of split
    y.narrow(2, 1, 2).sub_(3)
    y.unsqueeze(0)[0, 1:3].clamp_(min=-1.0)
    F.relu(y[2], inplace=True)
    y.view(-1)[:5].copy_(torch.arange(5.0, dtype=F64))
    return y


def _views_read_their_base(x):
    y = x.clone()
    row, flat, moved = y[:, 1], y.view(-1), y.permute(2, 0, 1)
    y.mul_(3)                             # in-place on the base: the views read it
    first = row + flat.view(4, 6, 8)[:, 1] + moved[0].sum()
    y[1:3] = 0.5                          # and again, through item assignment
    return first, row, moved[:, :2]


def _item_assignment(x):
    y = x.clone()
    y[0] = 1.0
    y[1, 2:4] = torch.arange(8.0, dtype=F64)
    y[..., -1] = y[..., 0] * 2
    y[2][3] = -2.0                        # through a view
    y[y > 1.5] = 0.0                      # a mask of the same shape
    y[torch.tensor([True, False, True, False])] = y[3, 0, 0]   # a mask over the first axis
    y[:, 1] += 1.0
    return y


def _contiguity_as_torch(x):
    y = x.clone()
    y.transpose(1, 2).contiguous().add_(100)   # a copy in torch: y unchanged
    y.transpose(1, 2).reshape(-1).add_(1000)   # a copy too
    y.reshape(-1)[0] = 42.0                    # a view
    c = y.contiguous()                         # y itself
    c[1] = 7.0
    return y, c is y


def _detach_and_data(x):
    y = x.clone()
    y.detach()[0, 0, 0] = 9.0
    y.data[1].zero_()
    return y


VIEWS = {"writes_through": _writes_through_views, "views_read_base": _views_read_their_base,
         "item_assignment": _item_assignment, "contiguity": _contiguity_as_torch,
         "detach_and_data": _detach_and_data}


def test_in_place_ops_on_views_write_through_as_torch():
    assert _bad_cases(VIEWS) == []


def _graph_program(x, w):
    y = x * w
    y[:, 0] = y[:, 0] * 2 + w[:, 1]
    y.view(4, 48)[:, :3] *= w[:, 0, :3]
    h = y.transpose(0, 1)
    y.relu_()
    out = (h * h).sum() + y[0][1].sum()
    z = y * 1
    z[1][2] = 0.0
    z.narrow(2, 4, 4).add_(z.narrow(2, 0, 4) * 2)
    return out + (z * w).sum()


@pytest.mark.parametrize("sbp", [sf.S(0), sf.S(2), sf.B], ids=str)
def test_gradients_through_in_place_ops_on_views_as_torch(sbp):
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.tensor(X, pl, sbp).requires_grad_()
        w = sf.tensor(W, pl, sf.B).requires_grad_()
        loss = _graph_program(x, w)
        loss.backward()
        return loss.item(), x.grad.full_tensor(), w.grad.full_tensor()
    got = sf.launch(body, world_size=2)[0]
    x, w = X.clone().requires_grad_(), W.clone().requires_grad_()
    loss = _graph_program(x, w)
    loss.backward()
    assert got[0] == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(got[1], x.grad)
    torch.testing.assert_close(got[2], w.grad)


def test_in_place_on_views_of_parameters_and_refusals():
    def body():
        pl = sf.placement("cpu", [0, 1])
        p = sf.nn.Parameter(sf.tensor(W[0], pl, sf.S(0)))
        local = p.local
        with torch.no_grad():
            p[0].fill_(1.0)                   # a view of a parameter: its shard is written
            p.data[1:3].mul_(0.0)
            p.t()[0, 3] = -5.0
        errors = []
        for fn in (lambda: p[0].add_(1.0),                       # torch: a view of a leaf
                   lambda: p.detach().expand(2, 6, 8).add_(1.0),  # overlapping elements
                   lambda: p.detach().__setitem__([0, 2], 1.0),   # an advanced index
                   lambda: setattr(p, "data", p.detach() * 2)):   # rebinding a shard
            try:
                fn()
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - the test reads the class
                errors.append(type(exc))
        return p.local is local, p.full_tensor(), errors
    same, value, errors = sf.launch(body, world_size=2)[0]
    want = W[0].clone()
    want[0] = 1.0
    want[1:3] = 0.0
    want[3, 0] = -5.0
    assert same
    torch.testing.assert_close(value, want)
    assert errors[0] is RuntimeError        # torch's own error
    assert issubclass(errors[1], sf.errors.UnsupportedTorchFunction)
    assert issubclass(errors[2], sf.errors.UnsupportedTorchFunction)
    assert issubclass(errors[3], sf.errors.UnsupportedTorchFunction)


# -- 4. user programs: a torchvision-style ResNet-18, a functional MLP ---------------------------
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNet18(nn.Module):
    """torchvision's resnet18, written here (not copied), with a width and input to scale."""

    def __init__(self, width: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, 2)
        self.layer2 = self._make_layer(width * 2, 2, stride=2)
        self.layer3 = self._make_layer(width * 4, 2, stride=2)
        self.layer4 = self._make_layer(width * 8, 2, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def _resnet_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 32, 32, generator=g, dtype=F64), torch.randint(0, 5, (8,), generator=g)


def _resnet_torch(model, x, y, steps: int):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        evaluated = model(x)
        top1 = (evaluated.argmax(dim=1) == y).float().mean().item()
        top3 = (evaluated.topk(3, 1).indices == y[:, None]).any(1).sum().item()
    return losses, model.state_dict(), evaluated, top1, top3


def _resnet_sf(model, x, y, steps: int):
    mesh = sf.placement("cpu", [0, 1, 2, 3])
    m = sf.parallel.apply(sf.nn.from_torch(model), mesh, {"*": sf.B})
    opt = sf.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    xs, ys = sf.tensor(x, mesh, sf.S(0)), sf.tensor(y, mesh, sf.S(0))
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(m(xs), ys)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    m.eval()
    with torch.no_grad():
        evaluated = m(xs)
        top1 = (evaluated.argmax(dim=1) == ys).float().mean().item()
        top3 = (evaluated.topk(3, 1).indices == ys[:, None]).any(1).sum().item()
    return losses, m.state_dict(), evaluated.full_tensor(), top1, top3


def test_torchvision_style_resnet18_trains_data_parallel_as_torch():
    torch.manual_seed(0)
    model = ResNet18().to(F64)
    x, y = _resnet_batch()
    want = _resnet_torch(model, x, y, 2)
    got = sf.launch(_resnet_sf, world_size=4, args=(model, x, y, 2))[0]
    assert got[0] == pytest.approx(want[0], rel=1e-10)
    assert list(got[1]) == list(want[1])      # weights, running means / vars, batch counts
    for k, v in want[1].items():
        torch.testing.assert_close(got[1][k], v, rtol=1e-9, atol=1e-11, msg=k)
    torch.testing.assert_close(got[2], want[2], rtol=1e-9, atol=1e-11)   # eval mode
    assert got[3:] == want[3:]                 # accuracy: argmax, ==, topk


class FunctionalMLP(nn.Module):
    """A plain torch MLP that calls torch.nn.functional for nearly everything."""

    def __init__(self, d_in: int = 8, hidden: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.w2 = nn.Parameter(torch.randn(hidden, hidden) / 4)
        self.b2 = nn.Parameter(torch.zeros(hidden))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)
        self.register_buffer("scale", torch.full((hidden,), 0.5))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x, target=None):
        self.calls += 1
        h = F.gelu(self.fc1(x))
        h = F.dropout(h, p=0.1, training=False)
        h = F.linear(h, self.w2, self.b2) * self.scale
        h = F.layer_norm(F.silu(h), (h.shape[-1],), self.norm.weight, self.norm.bias)
        h = F.leaky_relu(h, 0.1) + F.elu(h) * 0.1 + F.softplus(h) * 0.1
        logits = self.head(F.normalize(h, dim=-1) + torch.tanh(h) * 0.5)
        if target is None:
            return F.softmax(logits, dim=-1)
        logp = F.log_softmax(logits, dim=-1)
        return F.nll_loss(logp, target) + 0.1 * F.cross_entropy(logits, target) + \
            0.01 * F.mse_loss(logits, F.one_hot(target, 4).to(logits.dtype))


def _mlp_init(m):
    """A deterministic init through views and in-place ops, as a torch user writes one."""
    if isinstance(m, nn.Linear):
        with torch.no_grad():
            m.weight.copy_(torch.linspace(-0.5, 0.5, m.weight.numel()).reshape(m.weight.shape))
            m.weight.data[0].fill_(0.25)
            m.bias.zero_()
            m.bias.data[1:3] += 0.125


def _mlp_program(model, x, y, opt_cls):
    """What the probe does with a model (torch or converted): init, cast, count, train, infer."""
    model.apply(_mlp_init)
    model = model.to(torch.float64)
    count = sum(p.numel() for p in model.parameters())
    names = [n for n, _ in model.named_modules()]
    opt = opt_cls(model.parameters(), lr=0.05)
    losses = []
    for _ in range(2):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        probs = model(x)
    model.register_buffer("extra", torch.ones(3))
    return count, names, losses, probs, model.state_dict(), model.training


def test_functional_mlp_probe_as_torch():
    torch.manual_seed(0)
    model = FunctionalMLP()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 8, generator=g, dtype=F64)
    y = torch.randint(0, 4, (8,), generator=g)
    want = _mlp_program(copy.deepcopy(model), x, y, torch.optim.SGD)

    def body():
        mesh = sf.placement("cpu", [0, 1, 2, 3])
        m = sf.nn.from_torch(model, mesh)
        out = _mlp_program(m, sf.tensor(x, mesh, sf.S(0)), sf.tensor(y, mesh, sf.S(0)),
                           sf.optim.SGD)
        return out[:3] + (out[3].full_tensor(),) + out[4:]
    got = sf.launch(body, world_size=4)[0]
    assert got[0] == want[0] and got[1] == want[1] and got[5] is want[5] is False
    assert got[2] == pytest.approx(want[2], rel=1e-10)
    torch.testing.assert_close(got[3], want[3])
    assert list(got[4]) == list(want[4])
    for k, v in want[4].items():
        torch.testing.assert_close(got[4][k], v, msg=k)


# -- everyday calls of training scripts: each equals torch's, value and gradient ---------------------
_LO, _HI = _rand(6, 8, seed=4) * 0.3 - 0.5, _rand(8, seed=5) * 0.3 + 0.5
_EVERYDAY = {
    "add alpha": lambda x: x.add(x * 2, alpha=0.1),
    "torch.sub alpha": lambda x: torch.sub(x, x * 0.5, alpha=3),
    "add_ alpha (EMA)": lambda x: (x * 1).mul_(0.9).add_(x, alpha=0.1),
    "clamp tensors": lambda x: torch.clamp(x, min=_LO, max=_HI),
    "clamp_min tensor": lambda x: x.clamp_min(_LO),
    "sum dtype": lambda x: x.sum(dtype=torch.float32).double(),
    "mean dim dtype": lambda x: x.mean(1, dtype=torch.float32).double(),
    "floordiv": lambda x: (x.detach() * 4) // 1.5 + x,   # (no derivative, in torch too)
    "mod": lambda x: (x * 4) % 1.5 + x,
    "abs": lambda x: abs(x),
    "div floor": lambda x: (x * 4).div(1.5, rounding_mode="floor") + x,
    "div trunc": lambda x: (x * 4).div(1.5, rounding_mode="trunc") + x,
}


def _everyday(sbp) -> dict:
    pl = sf.placement("cpu", [0, 1])
    out = {}
    for name, f in _EVERYDAY.items():
        x = sf.tensor(X, pl, sbp).requires_grad_()
        y = f(x)
        y.sum().backward()
        out[name] = (y.full_tensor(), x.grad.full_tensor())
    loss = (sf.tensor(X, pl, sbp) * 2).sum()
    out["float int"] = (float(loss), int(loss))
    w = sf.tensor(W, pl, sf.B).requires_grad_()
    w.requires_grad = False   # torch's way to freeze
    out["frozen"] = (w.requires_grad, (w * 2).requires_grad)
    return out


@pytest.mark.parametrize("sbp", [sf.S(0), sf.B], ids=str)
def test_everyday_calls_equal_torch(sbp):
    """``add_(y, alpha=)`` (an EMA update), ``clamp`` with tensor bounds (recursed without end
    before), ``sum(dtype=)``, ``//``, ``%``, ``abs()``, ``div(rounding_mode=)``, ``float(loss)``,
    ``int(t)``, ``p.requires_grad = False``: each raised before."""
    got = sf.launch(_everyday, 2, args=(sbp,))[0]
    for name, f in _EVERYDAY.items():
        x = X.clone().requires_grad_()
        y = f(x)
        y.sum().backward()
        torch.testing.assert_close(got[name][0], y.detach(), rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(got[name][1], x.grad, rtol=1e-6, atol=1e-6, msg=name)
    want = float((X * 2).sum())
    assert got["float int"][0] == pytest.approx(want, rel=1e-12)   # (summed per shard)
    assert got["float int"][1] == int(want) and isinstance(got["float int"][1], int)
    assert got["frozen"] == (False, False)
