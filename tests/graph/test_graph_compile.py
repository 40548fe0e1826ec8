"""Compiling and replaying: ``build`` is traced on the first call with given input shapes and
layouts and replayed after (a new shape or layout compiles again, an old one is found again),
the results staying eager's; a module's train / eval mode is part of what a plan is compiled
for; random values drawn in ``build`` (dropout) are drawn anew on every call; ``print(graph)``
names the ops, parameters and boxing with the bytes it moves (those a replay moves);
``graph.plan()`` the actors."""

import re

import pytest
import torch

import sbpflow as sf
from graph_fns import EXAMPLES, TrainStep, graph_vs_eager
from sbpflow.models import layout

TOL = dict(rtol=1e-9, atol=1e-9)


def test_same_shapes_replay_new_shapes_compile_again():
    """Batches of 12, 12, 8, 12, 8 rows: two compiles; eager's losses and weights."""
    sizes = [12, 12, 8, 12, 8]
    run = sf.launch(graph_vs_eager, world_size=4, args=("mlp", "dp", 1, sizes))[0]
    eager, graph = run["eager"], run["graph"]
    assert graph["builds"] == [1, 1, 2, 2, 2]
    torch.testing.assert_close(graph["losses"], eager["losses"], **TOL)
    for k, v in eager["sd"].items():
        torch.testing.assert_close(graph["sd"][k], v, **TOL)


def _layouts_fn(sbps: list) -> dict:
    """The MLP on 2 ranks, a batch of 8 rows a step laid out ``sbps[i]`` (a split or a
    replicated batch), eagerly and by a graph: losses and the graph's traces after each call."""
    pl = sf.placement("cpu", [0, 1])
    ex = EXAMPLES["mlp"]
    out = {}
    for mode in ("eager", "graph"):
        sf.manual_seed(0)
        model = ex.make(sf.nn, sf.nn.functional).double()
        sf.parallel.apply(model, pl, {"*": sf.B})
        opt = sf.optim.SGD(model.parameters(), lr=0.1)
        step = TrainStep(model, opt)
        losses, builds = [], []
        for i, sbp in enumerate(sbps):
            x, y = (sf.tensor(v, pl, sbp) for v in ex.data(i, 8))
            if mode == "graph":
                loss = step(x, y)
            else:
                opt.zero_grad()
                loss = model(x, y)
                loss.backward()
                opt.step()
            losses.append(loss.to_global(pl, sf.B).local.item())
            builds.append(step.builds)
        out[mode] = losses, builds
    return out


def test_a_new_layout_compiles_again():
    sbps = [sf.S(0), sf.S(0), sf.B, sf.S(0), sf.B]
    run = sf.launch(_layouts_fn, world_size=2, args=(sbps,))[0]
    assert run["graph"][1] == [1, 1, 2, 2, 2]
    torch.testing.assert_close(run["graph"][0], run["eager"][0], **TOL)


# -- random values --------------------------------------------------------------------------------
class _Dropped(sf.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = sf.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x * 1.0)


class _Forward(sf.nn.Graph):
    """A forward-only graph returning the model's (non-scalar) output."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.builds = 0

    def build(self, x):
        self.builds += 1
        return self.model(x)


def _dropout_fn() -> dict:
    """Ones (8 x 6, split on 2 ranks) through dropout(0.5): 4 eager calls, then from the same
    seed 3 graph calls, one in eval mode, one more in train mode."""
    pl = sf.placement("cpu", [0, 1])
    x = sf.tensor(torch.ones(8, 6, dtype=torch.float64), pl, sf.S(0))
    sf.manual_seed(0)
    model = _Dropped()
    eager = [model(x).full_tensor() for _ in range(4)]
    sf.manual_seed(0)
    graph = _Forward(model)
    masks = [graph(x).full_tensor() for _ in range(3)]
    model.eval()
    evaluated = graph(x).full_tensor()
    builds_eval = graph.builds
    model.train()
    masks.append(graph(x).full_tensor())
    return dict(eager=eager, masks=masks, evaluated=evaluated, builds_eval=builds_eval,
                builds=graph.builds)


@pytest.fixture(scope="module")
def dropout_run():
    return sf.launch(_dropout_fn, world_size=2)


def test_dropout_draws_a_new_mask_on_every_call(dropout_run):
    run = dropout_run[0]
    masks = run["masks"]
    for m in masks:
        assert set(m.unique().tolist()) == {0.0, 2.0}  # kept values scaled by 1 / (1 - p)
        assert 0.25 < (m == 0).double().mean().item() < 0.75
    for i in range(len(masks)):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), (i, j)
    assert all(torch.equal(r["masks"][0], masks[0]) for r in dropout_run)  # one logical mask


def test_eval_mode_compiles_apart_and_train_mode_is_found_again(dropout_run):
    run = dropout_run[0]
    assert torch.equal(run["evaluated"], torch.ones(8, 6, dtype=torch.float64))
    assert run["builds_eval"] == 2 and run["builds"] == 2


def test_dropout_masks_follow_eagers_seed_stream(dropout_run):
    run = dropout_run[0]
    for i in range(3):
        assert torch.equal(run["masks"][i], run["eager"][i]), i


class _TwoStages(sf.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = sf.nn.Linear(4, 4), sf.nn.Linear(4, 4), sf.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.b(self.a(x))).sum()


class _Backward(sf.nn.Graph):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def build(self, x):
        loss = self.model(x)
        loss.backward()
        return loss


def _stream_after(graph: bool):
    """A 2-stage pipeline (rank 0, rank 1) whose dropout is on stage 1, run twice eagerly or
    as a graph; then a replicated ``sf.randn`` on both ranks, from the default seed stream."""
    sf.manual_seed(0)
    model = _TwoStages().double()
    stages = [sf.placement("cpu", [0]), sf.placement("cpu", [1])]
    sf.parallel.pipeline(model, stages, split=["b"])
    x = sf.tensor(torch.ones(4, 4, dtype=torch.float64), stages[0], sf.B)
    step = _Backward(model) if graph else None
    for _ in range(2):
        if step is not None:
            step(x)
        else:
            model(x).backward()
    return sf.randn(2, 3, placement=sf.placement("cpu", [0, 1]), sbp=sf.B,
                    dtype=torch.float64).local


def test_eager_keeps_every_ranks_seed_stream_alike():
    r0, r1 = sf.launch(_stream_after, world_size=2, args=(False,))
    assert torch.equal(r0, r1)


def test_a_graph_keeps_every_ranks_seed_stream_alike():
    r0, r1 = sf.launch(_stream_after, world_size=2, args=(True,))
    assert torch.equal(r0, r1)


# -- what the graph shows -----------------------------------------------------------------------
def test_print_and_plan_of_a_tensor_parallel_graph():
    """The MLP in tp on 4 ranks, 12 rows: the row-parallel layer's partial sums are
    reduce-scattered then gathered, (4 - 1) x 12 x 8 float64 = 2,304 B over the ranks each;
    the class-split softmax all-reduces its (12, 1) maxima and sums, 2 x 3 x 96 = 576 B."""
    run = sf.launch(graph_vs_eager, world_size=4, args=("mlp", "tp", 1, 12))
    text = run[0]["graph"]["text"]
    assert "1 stage(s), 1 micro-batch(es); inputs %0, %1" in text
    assert "stage 0 (ranks [0, 1, 2, 3]):" in text
    assert re.search(r"= linear\(%0, model\.net\.0\.weight, model\.net\.0\.bias\)  -> "
                     r"\(12, 16\) \(S\(1\),\)", text)
    assert re.search(r"= box\(%\d+\) \(P,\) -> \(S\(0\),\)  \[reduce_scatter 2,304 B\]", text)
    assert re.search(r"= box\(%\d+\) \(S\(0\),\) -> \(B,\)  \[all_gather 2,304 B\]", text)
    assert len(re.findall(r"\[all_reduce 576 B\]", text)) == 2
    assert "backward(%" in text
    assert "send" not in text
    for r, res in enumerate(run):
        plan = res["graph"]["plan"]
        names = re.findall(r"^  (\S+) \((\w+), stage 0, ", plan, re.M)
        assert names == [("fwd", "forward"), ("bwd", "backward"), ("grads", "compute"),
                         ("update", "update")], (r, plan)
        assert "saved[1 slots]" in plan  # one micro-batch


def test_repr_before_the_first_call():
    class Step(sf.nn.Graph):
        def build(self, x):
            return x

    step = Step()
    step.config.set_gradient_accumulation_steps(4)
    assert repr(step) == ("Step(not compiled yet; GraphConfig(micro_batches=4, "
                          "schedule='1f1b', loss_reduction='mean'))")


def _bytes_fn() -> tuple:
    """The MLP in tp on 4 ranks, a forward-only graph of 12 rows: its text, and this rank's
    communication counters over one replay."""
    lay = layout("mlp", "tp", 4)
    sf.manual_seed(0)
    model = EXAMPLES["mlp"].make(sf.nn, sf.nn.functional).double()
    sf.parallel.apply(model, lay.placement, lay.rules)
    graph = _Forward(model)
    x = sf.tensor(EXAMPLES["mlp"].data(0, 12)[0], lay.placement, lay.data_sbp)
    graph(x)
    sf.comm.reset_stats()
    graph(x)
    return str(graph), sf.comm.current().stats()


def test_the_bytes_print_shows_are_the_bytes_a_replay_moves():
    res = sf.launch(_bytes_fn, world_size=4)
    text = res[0][0]
    shown = [int(b.replace(",", "")) for b in re.findall(r"\[\w+ ([\d,]+) B\]", text)]
    assert shown == [0, 2304, 2304]  # the bias turning partial, reduce-scatter, all-gather
    assert sum(stats.sent for _, stats in res) == sum(shown)
    assert sum(stats.recv for _, stats in res) == sum(shown)
