"""What a graph refuses, with `sf.GraphError` naming the problem and the fix: a value computed
outside sbpflow's ops in ``build``, a batch that cannot be cut into k micro-batches, non-scalar
outputs with k > 1, nothing to cut, bad config values, reading a graph never called, a graph
without ``build``, placements sharing some ranks, unhashable non-tensor inputs, keyword
inputs that do not bind to ``build`` (those that do run), a scheduler whose ``step`` needs a
metric, ZeRO enabled after the first call. A refused call leaves the graph usable."""

import pytest
import torch

import sbpflow as sf
from sbpflow.graph import GraphConfig

F64 = torch.float64


class _Sum(sf.nn.Graph):
    def __init__(self, k: int = 1) -> None:
        super().__init__()
        self.config.set_gradient_accumulation_steps(k)

    def build(self, *xs):
        return (xs[0] * 2.0).sum()


class _FromLocal(sf.nn.Graph):
    def build(self, x):
        h = sf.from_local(torch.relu(x.local), x.placement, x.sbp, shape=x.shape)
        return (h * 2.0).sum()


class _Vector(_Sum):
    def build(self, x):
        return x * 2.0


class _Moves(sf.nn.Graph):
    def build(self, x, y):
        return (x.to_global(y.placement) * y).sum()


def _on_2_ranks(fn):
    """Run ``fn(placement)`` on 2 thread ranks (each raises alike: launch raises rank 0's)."""
    return sf.launch(lambda: fn(sf.placement("cpu", [0, 1])), world_size=2)


def _ones(pl, n, sbp=sf.B):
    return sf.tensor(torch.ones(n, 2, dtype=F64), pl, sbp)


def test_a_value_computed_in_torch_inside_build():
    with pytest.raises(sf.GraphError, match=r"op mul reads a tensor of shape \(3, 2\) on "
                       r"cpu\[0,1\] with sbp \(B,\) that build computed outside sbpflow's ops "
                       r"\(from_local on a torch result.*Compute it with sbpflow ops, or pass "
                       r"it to the graph as an input"):
        _on_2_ranks(lambda pl: _FromLocal()(_ones(pl, 3)))


def test_a_batch_that_cannot_be_cut_then_one_that_can():
    """3 replicated rows in 4 micro-batches; 6 rows split on 2 ranks (3 each) in 4. The
    message names a batch size that works; the same graph then runs a batch of 8."""
    def fn(pl):
        step = _Sum(4)
        msgs = []
        for x in (_ones(pl, 3), _ones(pl, 6, sf.S(0))):
            with pytest.raises(sf.GraphError) as info:
                step(x)
            msgs.append(str(info.value))
        return msgs, step(_ones(pl, 8, sf.S(0))).to_global(pl, sf.B).local.item()

    msgs, loss = _on_2_ranks(fn)[0]
    assert msgs[0].startswith("graph: cannot split the input of shape (3, 2) (sbp (B,) on "
                              "cpu[0,1]) into 4 micro-batches")
    assert "use a batch size that is a multiple of 4" in msgs[0]
    assert msgs[1].startswith("graph: cannot split the input of shape (6, 2) (sbp (S(0),) on "
                              "cpu[0,1]) into 4 micro-batches")
    assert "use a batch size that is a multiple of 8 (the micro-batches times the ranks " \
           "splitting the batch), or fewer micro-batches" in msgs[1]
    # "mean": each of the 4 micro-batches (2 rows of 2 ones, times 2: 8) weighs 1/4
    assert loss == 8.0


def test_micro_batch_weights_of_mean_and_sum_reductions():
    """A scalar output is the weighted sum of the micro-batches' values: with "mean" each
    weighs its share of the batch (5 rows in 3: 2/5, 2/5, 1/5), with "sum" 1."""
    def fn(pl, reduction):
        step = _Sum(3)
        step.config.set_loss_reduction(reduction)
        x = sf.tensor(torch.arange(10, dtype=F64).reshape(5, 2), pl, sf.B)
        return step(x).to_global(pl, sf.B).local.item()

    rows = torch.arange(10, dtype=F64).reshape(5, 2).sum(1) * 2.0  # each row's value
    mean = (2 / 5) * rows[:2].sum() + (2 / 5) * rows[2:4].sum() + (1 / 5) * rows[4:].sum()
    pl_fn = (lambda r: lambda pl: fn(pl, r))
    assert _on_2_ranks(pl_fn("mean"))[0] == pytest.approx(mean.item(), rel=1e-12)
    assert _on_2_ranks(pl_fn("sum"))[0] == pytest.approx(rows.sum().item(), rel=1e-12)


def test_non_scalar_output_with_micro_batches():
    with pytest.raises(sf.GraphError, match=r"with 2 micro-batches build may return only "
                       r"scalars .* not tensors of shapes \[\(2, 2\)\]"):
        _on_2_ranks(lambda pl: _Vector(2)(_ones(pl, 4)))


def test_micro_batches_but_nothing_to_cut():
    with pytest.raises(sf.GraphError, match=r"2 micro-batches but nothing to split: no input of "
                       r"build has the batch on axis 0 \(see config.set_split_inputs\)"):
        _on_2_ranks(lambda pl: _Sum(2)(sf.tensor(torch.tensor(3.0, dtype=F64), pl, sf.B)))


def test_split_flags_must_match_the_inputs():
    def fn(pl):
        step = _Sum()
        step.config.set_split_inputs(True, False)
        step(_ones(pl, 4))

    with pytest.raises(sf.GraphError, match=r"set_split_inputs got 2 flags for 1 inputs"):
        _on_2_ranks(fn)


def test_placements_sharing_some_ranks():
    def fn(pl):
        _Moves()(_ones(pl, 3), _ones(sf.placement("cpu", [1]), 3))

    with pytest.raises(sf.GraphError, match=r"placements on ranks \[1\] and \[0, 1\] share "
                       r"ranks \[1\]; graph mode cuts pipeline stages"):
        _on_2_ranks(fn)


def test_an_unhashable_constant_input():
    with pytest.raises(sf.GraphError, match=r"an input that is not a global tensor must be "
                       r"hashable \(it is a constant of the plan\); got list"):
        _on_2_ranks(lambda pl: _Sum()(_ones(pl, 2), [1, 2]))


@pytest.mark.parametrize("setter,value,message", [
    ("set_gradient_accumulation_steps", 0, "gradient accumulation steps must be an int >= 1, "
                                           "got 0"),
    ("set_gradient_accumulation_steps", 2.0, "must be an int >= 1, got 2.0"),
    ("set_gradient_accumulation_steps", True, "must be an int >= 1, got True"),
    ("set_pipeline_schedule", "x", "unknown pipeline schedule 'x'; one of ('1f1b', 'gpipe')"),
    ("set_loss_reduction", "max", "loss reduction must be 'mean' or 'sum', got 'max'"),
])
def test_bad_config_values(setter, value, message):
    config = GraphConfig()
    with pytest.raises(sf.GraphError) as info:
        getattr(config, setter)(value)
    assert message in str(info.value)
    assert (config.micro_batches, config.schedule, config.loss_reduction) == (1, "1f1b", "mean")


@pytest.mark.parametrize("what", ["timeline", "plan", "save_timeline", "save_trace"])
def test_reading_a_graph_never_called(what, tmp_path):
    args = (str(tmp_path / "x"),) if what.startswith("save") else ()
    with pytest.raises(sf.GraphError, match=r"_Sum has not been called yet: call it once "
                       r"\(which compiles it\) first"):
        getattr(_Sum(), what)(*args)
    assert list(tmp_path.iterdir()) == []


def test_build_not_defined():
    class NoBuild(sf.nn.Graph):
        pass

    with pytest.raises(sf.GraphError, match=r"NoBuild must define build\(self, \*inputs\)"):
        _on_2_ranks(lambda pl: NoBuild()(_ones(pl, 2)))


def test_add_optimizer_needs_an_optimizer():
    with pytest.raises(sf.GraphError, match="add_optimizer needs an optimizer, got object"):
        _Sum().add_optimizer(object())


class _Net(sf.nn.Graph):
    def __init__(self, model, how: str) -> None:
        super().__init__()
        self.model, self.how = model, how

    def build(self, x):
        if self.how == "checkpoint":
            loss = sf.nn.checkpoint(self.model, x).sum()
            loss.backward()
            return loss
        loss = self.model(x).sum()
        loss.backward()
        return (self.model.weight.grad * 1.0).sum()  # a gradient read in build


def _linear_fn(how: str):
    def fn(pl):
        sf.manual_seed(0)
        model = sf.nn.Linear(4, 4).double()
        sf.parallel.apply(model, pl, {"*": sf.B})
        x = sf.tensor(torch.ones(4, 4, dtype=F64), pl, sf.S(0))
        model(x).sum().backward()  # an eager step left gradients (build's backward is not run
        # while tracing: a fresh model's .grad is None there)
        return _Net(model, how)(x)
    return fn


def test_a_gradient_read_in_build():
    with pytest.raises(sf.GraphError, match=r"build reads \.grad of the tensor of shape \(4, 4\) "
                       r"on cpu\[0,1\] with sbp \(B,\); a graph runs backward after build"):
        _on_2_ranks(_linear_fn("grad"))


def test_activation_checkpointing_in_build():
    with pytest.raises(sf.GraphError, match="activation checkpointing"):
        _on_2_ranks(_linear_fn("checkpoint"))


def test_a_plain_torch_tensor_input_and_a_rank_outside_the_world():
    """A torch tensor input would be a constant of the plan hashed by identity (a new plan,
    and its threads, every call): refused, naming sf.tensor. ``plan(rank)`` of a rank outside
    the world is refused; the graph stays usable."""
    def fn(pl):
        g = _Sum()
        with pytest.raises(sf.GraphError, match=r"input 0 is a torch.Tensor of shape \(3, 2\)"
                           r".*sf.tensor\(x, placement, sbp\)"):
            g(torch.ones(3, 2, dtype=F64))
        assert g(_ones(pl, 3)).to_local().item() == 12.0
        with pytest.raises(sf.GraphError, match=r"rank must be an int in 0 .. 1"):
            g.plan(7)
        return g.plan(1)

    assert "rank 1" in _on_2_ranks(fn)[0]


class _Train(sf.nn.Graph):
    def __init__(self, w, opt) -> None:
        super().__init__()
        self.w = w
        self.add_optimizer(opt)

    def build(self, x):
        loss = (x * self.w).sum()
        loss.backward()
        return loss


def test_a_compiled_training_graph_called_under_no_grad_raises_as_a_first_call():
    """Grad mode is part of the compile key: under ``torch.no_grad()`` the build's backward
    raises as it does on a first call, instead of replaying the plan (which trained: the
    weights changed in a would-be validation call)."""
    def fn(pl):
        w = sf.nn.Parameter(sf.tensor(torch.ones(2, dtype=F64), pl, sf.B))
        g = _Train(w, sf.optim.SGD([w], lr=0.5))
        g(_ones(pl, 3))
        before = w.full_tensor().clone()
        with torch.no_grad(), pytest.raises(sf.SbpError, match="does not require grad"):
            g(_ones(pl, 3))
        assert torch.equal(w.full_tensor(), before)
        g(_ones(pl, 3))                                   # grad mode again: it trains
        return before, w.full_tensor()

    before, after = _on_2_ranks(fn)[0]
    assert torch.equal(before, torch.full((2,), -0.5, dtype=F64))   # 1 - 0.5 * 3
    assert torch.equal(after, torch.full((2,), -2.0, dtype=F64))


class _Named(sf.nn.Graph):
    def build(self, x, y, scale=3.0):
        return (x * scale + y).sum()


def test_keyword_inputs_bind_to_builds_parameters():
    def fn(pl):
        x, y = _ones(pl, 2), _ones(pl, 2) * 2.0
        g = _Named()
        values = [g(x, y).item(), g(x=x, y=y).item(), g(y=y, x=x).item(), g(x, y=y).item(),
                  g(x, y, scale=1.0).item()]
        errors = []
        for call in (lambda: g(x, z=y), lambda: g(x, y, x=x)):
            try:
                call()
            except sf.GraphError as exc:
                errors.append(str(exc))
        return values, errors
    values, errors = _on_2_ranks(fn)[0]
    assert values == [4 * 5.0] * 4 + [4 * 3.0]   # sum over (2, 2) of x*scale + y
    assert len(errors) == 2 and "_Named.build(x, y, scale=3.0)" in errors[0]
    assert "missing a required argument: 'y'" in errors[0] and "multiple values" in errors[1]


def test_a_scheduler_whose_step_needs_a_metric_is_refused():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(sf.GraphError, match=r"ReduceLROnPlateau.step needs \['metrics'\].*"
                                            r"call lr_sch.step\(...\) yourself"):
        _Sum().add_optimizer(opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(sf.GraphError, match="lr_sch must be a learning-rate scheduler"):
        _Sum().add_optimizer(opt, object())
    _Sum().add_optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 2))  # takes step()


def test_enable_zero_after_the_first_call_is_refused():
    class Step(sf.nn.Graph):
        def __init__(self, model, opt):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)

        def build(self, x):
            loss = self.model(x).sum()
            loss.backward()
            return loss

    def fn(pl):
        model = sf.nn.Linear(2, 4).double()
        sf.parallel.apply(model, pl, {"*": sf.B})
        step = Step(model, sf.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        step(_ones(pl, 4, sf.S(0)))
        step.config.enable_zero(3)
        try:
            step(_ones(pl, 6, sf.S(0)))  # a new batch size compiles again
        except sf.GraphError as exc:
            return str(exc), model.weight.sbp
    text, sbp = _on_2_ranks(fn)[0]
    assert "enable_zero(stage=3, min_size=0) after the graph's first call" in text
    assert "before the first call" in text and sbp == (sf.B,)
