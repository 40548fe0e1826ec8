"""What a graph's plan depends on besides its inputs, and the state ``build`` changes: in-place
writes to buffers and parameters replayed on every call; a plan compiled again when a module
build ran changes train / eval mode, under another autocast state, after the model's
parameters were replaced, or after an optimizer is added; gradient clipping in graph mode
(each against plain torch on one device); a graph is garbage once its launch ended."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

import sbpflow as sf
from sbpflow.errors import GraphError

F64 = torch.float64
_G = torch.Generator().manual_seed(3)
X = torch.randn(8, 6, generator=_G, dtype=F64)
Y = torch.randint(0, 4, (8,), generator=_G)


def _writer_class(nn, F, zero):
    """A linear classifier whose forward writes state in place, under ``no_grad``: a step
    counter and a loss EMA (buffers), a clamp of its weight and one bias entry set."""

    class Writer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 4)
            self.register_buffer("count", zero())
            self.register_buffer("ema", zero())

        def forward(self, x, y):
            loss = F.cross_entropy(self.lin(x), y)
            with torch.no_grad():
                self.count += 1
                self.ema.copy_(0.5 * self.ema + 0.5 * loss.detach())
                self.lin.weight.clamp_(-0.2, 0.2)
                self.lin.bias[0] = 0.0
            return loss

    return Writer


def _torch_writer(sd0: dict, steps: int) -> tuple:
    torch.manual_seed(0)
    m = _writer_class(torch.nn, torch.nn.functional, lambda: torch.zeros((), dtype=F64))()
    m.double().load_state_dict(sd0)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        loss = m(X, Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, m.state_dict()


class _Train(sf.nn.Graph):
    def __init__(self, model, opt, k: int = 1):
        super().__init__()
        self.model = model
        if opt is not None:
            self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(k)

    def build(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        return loss


class _Apply(sf.nn.Graph):
    """A graph of ``module(x)`` (its sum with ``summed``), the module registered."""

    def __init__(self, module, summed: bool = False):
        super().__init__()
        self.module, self.summed = module, summed

    def build(self, x):
        y = self.module(x)
        return y.sum() if self.summed else y


def _graph_writer(k: int) -> tuple:
    pl = sf.placement("cpu", [0, 1])
    sf.manual_seed(0)
    m = _writer_class(sf.nn, sf.nn.functional, lambda: sf.zeros((), placement=pl, dtype=F64))()
    m.double()
    sd0 = m.state_dict()
    sf.parallel.apply(m, pl, {"*": sf.B})
    step = _Train(m, sf.optim.SGD(m.parameters(), lr=0.5), k)
    x, y = sf.tensor(X, pl, sf.S(0)), sf.tensor(Y, pl, sf.S(0))
    losses = [step(x, y).item() for _ in range(3)]
    return sd0, losses, m.state_dict(), str(step)


def test_in_place_writes_in_build_are_replayed_on_every_call():
    """``+=`` / ``copy_`` on buffers and ``clamp_`` / ``x[i] = v`` on parameters under
    ``no_grad`` happen on each call (not once, when traced), and the trace's own writes are
    undone: three calls equal three torch steps, the counter reads 3."""
    sd0, losses, sd, shown = sf.launch(_graph_writer, 2, args=(1,))[0]
    want_losses, want_sd = _torch_writer(sd0, 3)
    torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-12)
    for name, value in want_sd.items():
        torch.testing.assert_close(sd[name], value, rtol=0, atol=1e-12, msg=name)
    assert sd["count"].item() == 3.0
    assert ".copy_(" in shown and "(in place)" in shown


def test_in_place_writes_run_once_a_micro_batch():
    """With gradient accumulation build runs once a micro-batch: the counter counts them."""
    _, _, sd, _ = sf.launch(_graph_writer, 2, args=(2,))[0]
    assert sd["count"].item() == 6.0


def _graph_modes() -> list:
    """A dropout layer reached only through a closure switches to eval after the first
    call, then back: each state's outputs."""
    pl = sf.placement("cpu", [0, 1])
    sf.manual_seed(0)
    net = sf.nn.Sequential(sf.nn.Linear(6, 4), sf.nn.Dropout(0.5)).double()
    sd0 = net.state_dict()
    sf.parallel.apply(net, pl, {"*": sf.B})

    class Apply(sf.nn.Graph):
        def build(self, x):
            return net(x)

    g, x = Apply(), sf.tensor(X, pl, sf.B)
    out = [g(x).full_tensor()]
    net[1].eval()
    out.append(g(x).full_tensor())
    net[1].train()
    out.append(g(x).full_tensor())
    return [sd0, out, len(g._compiled)]


def test_a_mode_change_of_a_module_build_ran_compiles_again():
    sd0, (train, evaluated, train_again), plans = sf.launch(_graph_modes, 2)[0]
    ref = torch.nn.Linear(6, 4).double()
    ref.load_state_dict({k.removeprefix("0."): v for k, v in sd0.items()})
    with torch.no_grad():
        torch.testing.assert_close(evaluated, ref(X), rtol=0, atol=1e-12)
        assert not torch.allclose(train, ref(X))   # dropout on: some entries dropped
    assert (train_again == 0).any() and plans == 2


def _graph_autocast() -> list:
    pl = sf.placement("cpu", [0, 1])
    sf.manual_seed(0)
    lin = sf.nn.Linear(6, 4)
    sd0 = lin.state_dict()
    sf.parallel.apply(lin, pl, {"*": sf.B})

    g, x = _Apply(lin), sf.tensor(X.float(), pl, sf.B)
    with sf.nn.autocast(torch.bfloat16):
        low = g(x).full_tensor()
    full = g(x).full_tensor()
    return [sd0, low, full]


def test_the_autocast_state_of_a_call_is_part_of_its_plan():
    sd0, low, full = sf.launch(_graph_autocast, 2)[0]
    ref = torch.nn.Linear(6, 4)
    ref.load_state_dict(sd0)
    with torch.no_grad():
        torch.testing.assert_close(full, ref(X.float()), rtol=0, atol=1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want_low = ref(X.float())
    assert low.dtype == torch.bfloat16 and full.dtype == torch.float32
    torch.testing.assert_close(low, want_low, rtol=0, atol=0)


def _graph_replaced(sd1: dict) -> torch.Tensor:
    pl = sf.placement("cpu", [0, 1])
    sf.manual_seed(0)
    lin = sf.nn.Linear(6, 4).double()
    sf.parallel.apply(lin, pl, {"*": sf.B})

    g, x = _Apply(lin), sf.tensor(X, pl, sf.B)
    g(x)
    sf.parallel.apply(lin, pl, {"weight": sf.S(0), "bias": sf.S(0)})   # new parameter objects
    lin.load_state_dict(sd1)
    return g(x).full_tensor()


def test_a_graph_reads_the_parameters_that_replaced_its_own():
    torch.manual_seed(1)
    ref = torch.nn.Linear(6, 4).double()
    got = sf.launch(_graph_replaced, 2, args=(ref.state_dict(),))[0]
    with torch.no_grad():
        torch.testing.assert_close(got, ref(X), rtol=0, atol=1e-12)


def _optimizer_added_late() -> tuple:
    pl = sf.placement("cpu", [0, 1])
    sf.manual_seed(0)
    lin = sf.nn.Linear(6, 4).double()
    sd0 = lin.state_dict()
    sf.parallel.apply(lin, pl, {"*": sf.B})
    g = _Train(lambda x, y: sf.nn.functional.cross_entropy(lin(x), y), None)
    x, y = sf.tensor(X, pl, sf.S(0)), sf.tensor(Y, pl, sf.S(0))
    g(x, y)   # gradients only
    opt = sf.optim.SGD(lin.parameters(), lr=0.5)
    opt.zero_grad()
    g.add_optimizer(opt)
    g(x, y)   # a step
    return sd0, lin.state_dict()


def test_an_optimizer_added_after_the_first_call_updates():
    sd0, sd = sf.launch(_optimizer_added_late, 2)[0]
    ref = torch.nn.Linear(6, 4).double()
    ref.load_state_dict(sd0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    torch.nn.functional.cross_entropy(ref(X), Y).backward()
    opt.step()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(sd[name], value, rtol=0, atol=1e-12, msg=name)


def _clipped(graph: bool) -> tuple:
    pl = sf.placement("cpu", [0, 1])
    sf.manual_seed(0)
    lin = sf.nn.Linear(6, 4).double()
    sd0 = lin.state_dict()
    sf.parallel.apply(lin, pl, {"*": sf.B})
    opt = sf.optim.SGD([{"params": lin.parameters(), "clip_grad_max_norm": 0.05}], lr=0.5)
    x, y = sf.tensor(X, pl, sf.S(0)), sf.tensor(Y, pl, sf.S(0))
    loss = lambda x, y: sf.nn.functional.cross_entropy(lin(x), y)  # noqa: E731
    if graph:
        step = _Train(loss, opt)
        for _ in range(2):
            step(x, y)
    else:
        for _ in range(2):
            loss(x, y).backward()
            opt.step()
            opt.zero_grad()
    return sd0, lin.state_dict()


@pytest.mark.parametrize("graph", [False, True])
def test_a_parameter_group_clips_its_gradients_in_the_update(graph):
    """``clip_grad_max_norm`` in a parameter group (OneFlow's way, the one a graph can run)
    equals torch's ``clip_grad_norm_`` then ``step``."""
    sd0, sd = sf.launch(_clipped, 2, args=(graph,))[0]
    ref = torch.nn.Linear(6, 4).double()
    ref.load_state_dict(sd0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(2):
        torch.nn.functional.cross_entropy(ref(X), Y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    assert norm > 0.05   # the clip acts
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(sd[name], value, rtol=0, atol=1e-12, msg=name)


def _clip_in_build():
    pl = sf.placement("cpu", [0, 1])
    lin = sf.nn.Linear(6, 4).double()
    sf.parallel.apply(lin, pl, {"*": sf.B})

    class Clipping(sf.nn.Graph):
        def build(self, x, y):
            loss = sf.nn.functional.cross_entropy(lin(x), y)
            loss.backward()
            sf.optim.clip_grad_norm_(lin.parameters(), 0.05)
            return loss

    Clipping()(sf.tensor(X, pl, sf.S(0)), sf.tensor(Y, pl, sf.S(0)))


def test_clipping_in_build_is_refused_naming_the_way_that_works():
    """Before, the trace clipped no gradient (there are none yet) and the update was not
    clipped, silently."""
    with pytest.raises(GraphError, match="clip_grad_max_norm"):
        sf.launch(_clip_in_build, 2)


_GONE: list = []   # weak references to what each rank's graph held


def _graph_and_go() -> float:
    pl = sf.placement("cpu", [0, 1])
    lin = sf.nn.Linear(6, 4).double()
    sf.parallel.apply(lin, pl, {"*": sf.B})

    g = _Apply(lin, summed=True)
    out = g(sf.tensor(X, pl, sf.B)).item()
    _GONE.extend([weakref.ref(g), weakref.ref(lin)])
    return out


def test_a_graph_is_garbage_after_its_launch():
    """The runtime's per-communicator state held the last run, so the runtime, the
    communicator (the state's own weak key) and everything the graph held (a model, a data
    loader's worker processes) lived as long as the process."""
    sf.launch(_graph_and_go, 2)
    deadline = time.monotonic() + 10   # (idle threads look at their owner every 0.25 s)
    while any(r() is not None for r in _GONE) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert len(_GONE) == 4 and all(r() is None for r in _GONE)


def _count_output():
    pl = sf.placement("cpu", [0, 1])
    lin = sf.nn.Linear(6, 4).double()
    sf.parallel.apply(lin, pl, {"*": sf.B})

    class Count(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.config.set_gradient_accumulation_steps(2)

        def build(self, x, y):
            return (lin(x).argmax(-1) == y).sum()

    Count()(sf.tensor(X, pl, sf.S(0)), sf.tensor(Y, pl, sf.S(0)))


def test_an_integer_output_over_micro_batches_is_refused():
    """Before, a count came back as the micro-batches' weighted mean, in float32."""
    with pytest.raises(GraphError, match=r"scalars of \['torch.int64'\].*c.double\(\) / n"):
        sf.launch(_count_output, 2)


def _nested_inputs(kind: str, k: int, batches: list, sd0: dict) -> tuple:
    pl = sf.placement("cpu", [0, 1])
    lin = sf.nn.Linear(6, 4).double()
    lin.load_state_dict(sd0)
    sf.parallel.apply(lin, pl, {"*": sf.B})

    class Nested(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.add_optimizer(sf.optim.SGD(lin.parameters(), lr=0.5))
            self.config.set_gradient_accumulation_steps(k)

        def build(self, batch):
            x, y = (batch["x"], batch["y"]) if kind == "dict" else batch
            loss = sf.nn.functional.cross_entropy(lin(x), y)
            loss.backward()
            return loss

    g, losses = Nested(), []
    for x, y in batches:
        x, y = sf.tensor(x, pl, sf.S(0)), sf.tensor(y, pl, sf.S(0))
        losses.append(g({"x": x, "y": y} if kind == "dict" else (x, y)).item())
    return losses, len(g._compiled)


@pytest.mark.parametrize("kind,k", [("tuple", 1), ("dict", 2)])
def test_a_tuple_or_dict_input_is_its_tensors(kind, k):
    """Its tensors are inputs of the plan, split into micro-batches: one compile for three
    batches (before, the tuple was a constant of the plan: a compile a call, or with k > 1
    'nothing to split'; a dict was refused)."""
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 6, generator=g, dtype=F64), torch.randint(0, 4, (8,), generator=g))
               for _ in range(3)]
    ref = torch.nn.Linear(6, 4).double()
    sd0 = {n: v.clone() for n, v in ref.state_dict().items()}
    losses, plans = sf.launch(_nested_inputs, 2, args=(kind, k, batches, sd0))[0]
    opt, want = torch.optim.SGD(ref.parameters(), lr=0.5), []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    torch.testing.assert_close(losses, want, rtol=0, atol=1e-12)
    assert plans == 1


def _constant_written() -> list:
    pl = sf.placement("cpu", [0, 1])
    lin = sf.nn.Linear(6, 4).double()
    sf.parallel.apply(lin, pl, {"*": sf.B})

    class Tally(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.add_optimizer(sf.optim.SGD(lin.parameters(), lr=0.5))

        def build(self, x, y):
            loss = sf.nn.functional.cross_entropy(lin(x), y)
            loss.backward()
            total = sf.zeros((), placement=pl, dtype=F64)   # made afresh by each eager call
            with torch.no_grad():
                total += 2 * loss.detach()
            return loss, total

    g = Tally()
    x, y = sf.tensor(X, pl, sf.S(0)), sf.tensor(Y, pl, sf.S(0))
    return [(loss.item(), total.item()) for loss, total in (g(x, y) for _ in range(3))]


def test_a_constant_build_makes_and_writes_starts_afresh_each_call():
    for loss, total in sf.launch(_constant_written, 2)[0]:
        assert total == 2 * loss
