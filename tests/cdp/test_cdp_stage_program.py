"""A CDP stage whose call is local kernels only replays them (`stage_program`): the values and
gradients equal plain torch's bit for bit, and a stage that draws random numbers stays eager,
its trace leaving the default seed stream where it was."""

import pytest
import torch

import sbpflow as sf
from sbpflow.parallel.cdp.stage_runner import StageRunner

F64 = torch.float64


def test_a_linear_tanh_stage_replays_torch_kernels():
    def fn():
        sf.manual_seed(0)
        runner = StageRunner(sf.nn.Sequential(sf.nn.Linear(6, 4, dtype=F64), sf.nn.Tanh()), 0)
        pl = sf.placement("cpu", [0])
        version = runner.version([t.clone() for t in runner.initial()])
        w, b = version
        g = torch.Generator().manual_seed(3)
        out = []
        for _ in range(3):  # the trace, the checked first call, then replays
            x = torch.randn(5, 6, dtype=F64, generator=g).requires_grad_(True)
            got, changes = runner.forward(version, x, pl)
            want = torch.tanh(torch.nn.functional.linear(x, w, b))
            seed = torch.randn(5, 4, dtype=F64, generator=g)
            grads = StageRunner.backward(got, seed, [x, w, b])
            wants = torch.autograd.grad([want], [x, w, b], [seed])
            out.append((torch.equal(got, want), all(map(torch.equal, grads, wants)), changes))
        tapes = list(runner.tapes.values())
        return out, [(t is not None and t.checked, len(t.nodes)) for t in tapes]
    out, tapes = sf.launch(fn, world_size=1)[0]
    assert out == [(True, True, [])] * 3
    assert tapes == [(True, 2)]   # one key: linear and tanh


def test_a_random_stage_stays_eager_and_keeps_the_seed_stream():
    def fn():
        sf.manual_seed(0)
        runner = StageRunner(sf.nn.Sequential(sf.nn.Linear(6, 6, dtype=F64),
                                              sf.nn.Dropout(0.5)), 0)
        pl = sf.placement("cpu", [0])
        version = runner.version([t.clone() for t in runner.initial()])
        x = torch.ones(4, 6, dtype=F64)
        state = sf.comm.current().per_rank
        before = state.seed_counter
        tape = runner._tape(x, pl, None, None)
        after_trace = state.seed_counter
        got, _ = runner.forward(version, x, pl)
        return tape, before, after_trace, state.seed_counter, got
    tape, before, after_trace, after_call, got = sf.launch(fn, world_size=1)[0]
    assert tape is None
    assert after_trace == before and after_call == before + 1   # the eager call drew one seed
    assert got.shape == (4, 6)


class _HalfFrozen(sf.nn.Module):
    """A stage that computes part of its output under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = sf.nn.Linear(6, 6, dtype=F64)

    def forward(self, x):
        with torch.no_grad():
            s = x * 2.0
        return self.lin(x) + s


def test_no_grad_inside_a_stage_and_forward_hooks():
    """A replayed op runs in the grad mode it was traced in (x's gradient flows through the
    Linear only, as in torch); a stage with a forward hook stays eager (the hook runs every
    call)."""
    def fn():
        sf.manual_seed(0)
        module = _HalfFrozen()
        runner = StageRunner(module, 0)
        pl = sf.placement("cpu", [0])
        version = runner.version([t.clone() for t in runner.initial()])
        w, b = version
        g = torch.Generator().manual_seed(5)
        same = []
        for _ in range(3):
            x = torch.randn(3, 6, dtype=F64, generator=g).requires_grad_(True)
            got, _ = runner.forward(version, x, pl)
            with torch.no_grad():
                s = x * 2.0
            want = torch.nn.functional.linear(x, w, b) + s
            seed = torch.randn(3, 6, dtype=F64, generator=g)
            grads = StageRunner.backward(got, seed, [x, w, b])
            wants = torch.autograd.grad([want], [x, w, b], [seed])
            same.append(torch.equal(got, want) and all(map(torch.equal, grads, wants)))
        replayed = all(t is not None and t.checked for t in runner.tapes.values())
        calls = []
        module.lin.register_forward_hook(lambda *_: calls.append(1))
        for _ in range(3):
            runner.forward(version, torch.randn(3, 6, dtype=F64, generator=g), pl)
        return same, replayed, len(calls)
    same, replayed, calls = sf.launch(fn, world_size=1)[0]
    assert same == [True] * 3 and replayed
    assert calls == 3


@pytest.mark.parametrize("program", ["1", "0"])
def test_a_replayed_loss_raises_eagers_error_and_runs_as_one_program(monkeypatch, program):
    """A last stage (Linear, then the loss) replays as one generated function; a target out
    of range raises in the replay the error the eager call raises (the rule the op was traced
    under turns torch's error into sbpflow's); with SBPFLOW_GRAPH_PROGRAM=0, by the walk."""
    monkeypatch.setenv("SBPFLOW_GRAPH_PROGRAM", program)

    def loss(out, y):
        return sf.nn.functional.cross_entropy(out, y)

    def fn():
        sf.manual_seed(0)
        runners = [StageRunner(sf.nn.Linear(6, 3, dtype=F64), 0, programs=p)
                   for p in (True, False)]
        pl = sf.placement("cpu", [0])
        g = torch.Generator().manual_seed(4)
        x = torch.randn(5, 6, dtype=F64, generator=g).requires_grad_(True)
        y = torch.randint(0, 3, (5,), generator=g)
        version = runners[0].version([t.clone() for t in runners[0].initial()])
        for _ in range(3):
            got, _ = runners[0].forward(version, x, pl, loss, y)
        want, _ = runners[1].forward(version, x, pl, loss, y)
        bad = y.clone()
        bad[2] = 7
        errors = []
        for r in runners:
            try:
                r.forward(version, x, pl, loss, bad)
            except Exception as exc:  # noqa: BLE001 - the two errors are compared
                errors.append((type(exc), str(exc)))
        tape = next(iter(runners[0].tapes.values()))
        source = getattr(tape.program, "source", "")
        return torch.equal(got, want), errors, tape.checked, "def run(" in source
    same, errors, checked, generated = sf.launch(fn, world_size=1)[0]
    assert same and checked and generated == (program == "1")
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert issubclass(errors[0][0], sf.SbpError) and "7" in errors[0][1]


@pytest.mark.parametrize("engine", [True, False])
def test_a_backward_seeded_by_a_gradient_equals_autograd_grad(monkeypatch, engine):
    """`StageRunner.backward` calls torch's engine directly (or, where torch lacks that entry,
    autograd.grad): the gradients equal autograd.grad's, zeros for an unused input; a loss
    is seeded with 1, a non-scalar without a seed refused as torch refuses it."""
    from sbpflow.parallel.cdp import stage_runner
    if not engine:
        monkeypatch.setattr(stage_runner, "_engine_run_backward", None)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 3, dtype=F64, generator=g).requires_grad_(True)
    w = torch.randn(3, 3, dtype=F64, generator=g).requires_grad_(True)
    unused = torch.randn(2, dtype=F64, generator=g).requires_grad_(True)
    seed = torch.randn(4, 3, dtype=F64, generator=g)
    got = StageRunner.backward(torch.tanh(x @ w), seed, [x, w, unused])
    want = torch.autograd.grad([torch.tanh(x @ w)], [x, w], [seed])
    assert all(map(torch.equal, got[:2], want)) and torch.equal(got[2], torch.zeros(2, dtype=F64))
    # a scalar loss, seeded with 1 as autograd.grad seeds it
    got = StageRunner.backward(torch.tanh(x @ w).sum(), None, [x, w])
    want = torch.autograd.grad([torch.tanh(x @ w).sum()], [x, w])
    assert all(map(torch.equal, got, want))
    with pytest.raises(RuntimeError, match="scalar outputs"):  # torch's own words
        StageRunner.backward(torch.tanh(x @ w), None, [x, w])
