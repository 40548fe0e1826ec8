"""Pipelines in graph mode equal one-device torch (float64): the GPT of `graph_fns` cut by
`sf.parallel.pipeline` into 2, 3 and 4 single-rank stages, GPipe and 1F1B, 1 to 16 micro-batches
(uneven ones too), and 2 stages of 2 data-parallel, 2 tensor-parallel and 2x2 ranks, trained 3
AdamW steps as a graph, give the torch twin's losses and weights. The timeline of the last step
keeps the schedule's bound on each rank: 1F1B S - s micro-batches in flight on stage s, GPipe
all M. Stage 0, whose inputs are all there from the start, reaches the bound exactly; a later
stage reaches it only when its producer keeps ahead of the backward coming back, which is a
matter of thread timing (one run in many saw a middle stage hold 1 where 1F1B allows 2)."""

import pytest
import torch

import sbpflow as sf
from graph_fns import STEPS, gpt_pipeline, torch_gpt
from sbpflow.models import TP_RULES
from sbpflow.runtime import in_flight

TOL = dict(rtol=1e-9, atol=1e-9)
SPLITS = {2: ["blocks.2"], 3: ["blocks.1", "blocks.3"], 4: ["blocks.1", "blocks.2", "blocks.3"]}
TP = dict(TP_RULES["gpt"])
TP2D = {k: (sf.B, v) for k, v in TP.items()}


def _close(a, b, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64),
                               torch.as_tensor(b, dtype=torch.float64), **TOL,
                               msg=lambda m: f"{what}: {m}")


def _check(results: list, n: int) -> None:
    """Rank 0's losses and final weights equal the torch twin's, every weight trained; every
    rank saw the same losses."""
    run = results[0]
    t_losses, t_sd = torch_gpt(run["sd0"], n)
    for r in results[1:]:
        assert r["losses"] == run["losses"]
    _close(run["losses"], t_losses, "losses")
    assert set(run["sd"]) == set(t_sd)
    for k, v in t_sd.items():
        _close(run["sd"][k], v, f"weight {k}")
        assert not torch.equal(v, run["sd0"][k]), f"{k} was not trained"
    assert run["builds"] <= 2  # one trace a distinct micro-batch shape, then replays only


def _bound(schedule: str, s: int, stages: int, m: int) -> int:
    return m if schedule == "gpipe" else min(stages - s, m)


def _check_in_flight(results: list, stage_ranks: list, m: int, schedule: str) -> None:
    """Per rank (``in_flight`` counts every event it is given: one rank's at a time): at most
    the bound, and the bound itself on stage 0."""
    events = results[0]["events"]
    for s, ranks in enumerate(stage_ranks):
        bound = _bound(schedule, s, len(stage_ranks), m)
        for r in torch.tensor(ranks).flatten().tolist():
            mine = [e for e in events if e["rank"] == r]
            (stage, peak), = in_flight(mine).items()
            assert stage == s and 1 <= peak <= bound, (r, s, peak, bound)
            assert s > 0 or peak == bound, (r, peak, bound)


# (stages, micro-batches, schedule, batch): 10 rows in 8 or 5 micro-batches are uneven (2 or 1
# rows), 16 micro-batches need 16 rows
SINGLE = [(2, 1, "1f1b", 10), (2, 2, "gpipe", 10), (2, 5, "1f1b", 10), (3, 5, "1f1b", 10),
          (3, 5, "gpipe", 10), (4, 8, "1f1b", 10), (4, 8, "gpipe", 10), (4, 16, "1f1b", 16),
          (4, 16, "gpipe", 16)]


@pytest.mark.parametrize("stages,m,schedule,n", SINGLE,
                         ids=[f"S{s}-M{m}-{sch}" for s, m, sch, _ in SINGLE])
def test_single_rank_stages_equal_torch(stages, m, schedule, n):
    ranks = [[r] for r in range(stages)]
    results = sf.launch(gpt_pipeline, world_size=stages,
                        args=(ranks, SPLITS[stages], None, sf.B, n, m, schedule))
    _check(results, n)
    _check_in_flight(results, ranks, m, schedule)


# 2 stages of 2 ranks: data parallel (10 rows: each rank's 5 cut 2, 2, 1 -> micro-batches of 4,
# 4, 2), tensor parallel (10 replicated rows in 4, 3, 3)
PAIRS = [("dp", 3, "1f1b", 10), ("dp", 2, "gpipe", 12), ("tp", 3, "1f1b", 10),
         ("tp", 2, "gpipe", 12)]


@pytest.mark.parametrize("kind,m,schedule,n", PAIRS,
                         ids=[f"{k}-M{m}-{sch}" for k, m, sch, _ in PAIRS])
def test_stages_of_two_ranks_equal_torch(kind, m, schedule, n):
    ranks = [[0, 1], [2, 3]]
    rules, data = ([{"*": sf.B}] * 2, sf.S(0)) if kind == "dp" else ([TP, TP], sf.B)
    results = sf.launch(gpt_pipeline, world_size=4,
                        args=(ranks, SPLITS[2], rules, data, n, m, schedule))
    _check(results, n)
    _check_in_flight(results, ranks, m, schedule)


def test_stages_on_2x2_meshes_equal_torch():
    """Each stage a 2x2 mesh: data parallel over its rows, tensor parallel inside a row."""
    ranks = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    results = sf.launch(gpt_pipeline, world_size=8,
                        args=(ranks, SPLITS[2], [TP2D, TP2D], (sf.S(0), sf.B), 8, 2, "1f1b"))
    _check(results, 8)
    _check_in_flight(results, ranks, 2, "1f1b")


# stages on ranks in any order, of different sizes
MIXED = {"reversed": ([[3], [2], [1], [0]], SPLITS[4], 4),
         "1-2-1": ([[0], [1, 2], [3]], SPLITS[3], 5)}


@pytest.mark.parametrize("case", list(MIXED))
def test_stages_on_any_ranks_equal_torch(case):
    ranks, split, m = MIXED[case]
    results = sf.launch(gpt_pipeline, world_size=4,
                        args=(ranks, split, None, sf.B, 10, m, "1f1b"))
    _check(results, 10)
    _check_in_flight(results, ranks, m, "1f1b")


def test_targets_given_on_the_last_stage_equal_torch():
    """As torch's pipelining takes them: the model's inputs follow the stages from where they
    are given, so the targets never go back to stage 0 (a 'cycle' GraphError before)."""
    ranks = [[0], [1], [2]]
    results = sf.launch(gpt_pipeline, world_size=3,
                        args=(ranks, SPLITS[3], None, sf.B, 10, 4, "1f1b", STEPS, None, 2))
    _check(results, 10)
    _check_in_flight(results, ranks, 4, "1f1b")


def _two_stage_mlp(sd0: dict):
    """A Linear-Tanh-Linear (float64) holding ``sd0``, cut into stages on ranks 0 and 1."""
    stages = [sf.placement("cpu", [0]), sf.placement("cpu", [1])]
    m = sf.nn.Sequential(sf.nn.Linear(4, 6), sf.nn.Tanh(), sf.nn.Linear(6, 3)).double()
    m.load_state_dict(sd0)
    sf.parallel.pipeline(m, stages, split=["2"])
    return m, stages


class _SquaredMean(sf.nn.Graph):
    """``mean(model(x)**2)``, 2 micro-batches; ``opt`` (if any) steps after each call."""

    def __init__(self, model, opt=None):
        super().__init__()
        self.m = model
        if opt is not None:
            self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(2)

    def build(self, x):
        loss = self.m(x).pow(2).mean()
        loss.backward()
        return loss


def _torch_mlp(seed: int):
    g = torch.Generator().manual_seed(seed)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(),
                              torch.nn.Linear(6, 3)).double()
    return ref, {k: v.clone() for k, v in ref.state_dict().items()}, g


def test_without_an_optimizer_every_rank_reads_every_gradient():
    """A pipelined graph with no optimizer leaves the gradients, as eager backward does: on a
    rank outside a parameter's stage, its empty gradient shard (was None there, so reading
    ``p.grad`` failed on some ranks only); the values equal torch's."""
    ref, sd0, g = _torch_mlp(2)
    x = torch.randn(8, 4, dtype=torch.float64, generator=g)
    ref(x).pow(2).mean().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    def body():
        m, stages = _two_stage_mlp(sd0)
        _SquaredMean(m)(sf.tensor(x, stages[0], sf.S(0)))
        return {n: None if p.grad is None else p.grad.full_tensor()
                for n, p in m.named_parameters()}
    for grads in sf.launch(body, world_size=2):
        assert set(grads) == set(want)
        for n, v in want.items():
            assert grads[n] is not None, n
            _close(grads[n], v, f"grad {n}")


def test_a_pipelined_graph_keeps_adam_state_for_every_parameter_on_every_rank():
    """AdamW over a pipelined graph: each rank counts the steps of the other stage's
    parameters too (their update on the empty shard is only that bookkeeping), so every
    rank's state dict is torch's: the same entries, steps and moments."""
    ref, sd0, g = _torch_mlp(6)
    xs = [torch.randn(8, 4, dtype=torch.float64, generator=g) for _ in range(2)]
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for x in xs:
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    want = opt.state_dict()["state"]

    def body():
        m, stages = _two_stage_mlp(sd0)
        o = sf.optim.AdamW(m.parameters(), lr=0.1)
        step = _SquaredMean(m, o)
        for x in xs:
            step(sf.tensor(x, stages[0], sf.S(0)))
        return o.state_dict()["state"], m.state_dict()
    for state, sd in sf.launch(body, world_size=2):
        assert sorted(state) == sorted(want) == [0, 1, 2, 3]
        for i, entry in want.items():
            assert set(state[i]) == set(entry)
            for key, v in entry.items():
                _close(state[i][key], v, f"optimizer state {i}.{key}")
        for k, v in ref.state_dict().items():
            _close(sd[k], v, f"weight {k}")


def test_a_pipelined_graph_checkpoint_resumes_as_torch(tmp_path):
    """After a pipelined graph step with SGD momentum, the optimizer keeps state for every
    parameter on every rank, as eager (another stage's empty): ``sf.save`` writes it (it
    refused: ranks saved other tensors), and an eager pipeline loading it takes a second step
    equal to torch's second step."""
    ref, sd0, g = _torch_mlp(4)
    xs = [torch.randn(8, 4, dtype=torch.float64, generator=g) for _ in range(2)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x in xs:
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    want = ref.state_dict()

    def body():
        m, stages = _two_stage_mlp(sd0)
        o = sf.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        _SquaredMean(m, o)(sf.tensor(xs[0], stages[0], sf.S(0)))
        keys = sorted(o.state_dict()["state"])
        sf.save(str(tmp_path), m, o, step=1)
        m2, _ = _two_stage_mlp(sd0)
        o2 = sf.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        sf.load(str(tmp_path), m2, o2)
        m2(sf.tensor(xs[1], stages[0], sf.S(0))).pow(2).mean().backward()
        o2.step()
        return keys, m2.state_dict()   # whole values (torch tensors) on every rank
    for keys, sd in sf.launch(body, world_size=2):
        assert keys == [0, 1, 2, 3]
        for k, v in want.items():
            _close(sd[k], v, f"weight {k}")
