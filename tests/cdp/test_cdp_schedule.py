"""Cyclic Data Parallelism as data (issue 16, ../shared/CDP.md section (e)): the timeline, the
version tables, live activations, gradient chunks per step, the settings' rank counts, the
tasks' order (no dependency goes backwards), and `split=`."""

import math

import pytest
import torch

import sbpflow as sf
from sbpflow.parallel.cdp import CyclicDataParallel, cycles, program, roles, rules
from sbpflow.parallel.cdp.stage_split import flop_weights, split_sequential

# the spec's N = 4 CDP timeline, steps 0-13 (workers 1-4)
SPEC_CDP4 = """\
F1c0 - - -
F2c0 - - -
F3c0 F1c0 - -
F4c0 F2c0 - -
B4c0 F3c0 F1c0 -
B3c0 F4c0 F2c0 -
B2c0 B4c0 F3c0 F1c0
B1c0 B3c0 F4c0 F2c0
F1c1 B2c0 B4c0 F3c0
F2c1 B1c0 B3c0 F4c0
F3c1 F1c1 B2c0 B4c0
F4c1 F2c1 B1c0 B3c0
B4c1 F3c1 F1c1 B2c0
B3c1 F4c1 F2c1 B1c0"""


def test_cdp_timeline_is_the_spec_table():
    got = cycles.table("cdp", 4, 2)[:14]
    assert [" ".join(row) for row in got] == SPEC_CDP4.splitlines()


def test_dp_timeline_is_lock_step():
    rows = cycles.table("dp", 4, 2)
    assert rows[0] == ["F1c0"] * 4 and rows[3] == ["F4c0"] * 4
    assert rows[4] == ["B4c0"] * 4 and rows[7] == ["B1c0"] * 4 and rows[8] == ["F1c1"] * 4


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 8])
def test_cdp_steady_state_uses_each_stage_once_a_step(n):
    ops = cycles.ops("cdp", n, 6)
    by_step = {}
    for o in ops:
        by_step.setdefault(o.step, []).append(o.stage)
    for k in range(2 * (n - 1), 2 * n * 5):  # after worker N's start, before the drain
        assert sorted(by_step[k]) == list(range(n)), k


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_update_steps_and_v2_is_latest_published(n):
    for c in range(3):
        for j in range(n):  # the spec's 2N(c+2) - 2 - j (1-based j)
            assert cycles.update_step("cdp", n, j, c) == 2 * n * (c + 2) - 2 - (j + 1)
            assert cycles.update_step("dp", n, j, c) == 2 * n * (c + 1) - (j + 1)
    for c in range(1, 4):
        for i in range(n):
            for j in range(n):
                f = cycles.step_of("cdp", n, "F", i, j, c)
                published = max((v + 1 for v in range(c)
                                  if cycles.update_step("cdp", n, j, v) < f), default=0)
                assert rules.version("v2", c, i, j, n) == published
                assert rules.version("v1", c, i, j, n) == c - 1
                assert rules.version("dp", c, i, j, n) == c


def test_version_tables():
    assert rules.version_table("v2", 4) == [list("SSSF"), list("SSFF"), list("SFFF"),
                                            list("FFFF")]
    assert rules.version_table("v1", 3) == [list("SSS")] * 3
    assert rules.version_table("dp", 3) == [list("FFF")] * 3
    for n in range(2, 9):
        fresh = sum(row.count("F") for row in rules.version_table("v2", n))
        assert fresh / n ** 2 == pytest.approx((n + 1) / (2 * n))
    assert rules.version("v1", 0, 0, 0, 4) == 0  # theta_{-1} := theta_0


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 8])
def test_live_activations(n):
    dp = cycles.live_activations("dp", n, 4)
    assert max(dp) == n * n
    assert dp[:2 * n] == [n * k for k in range(1, n + 1)] + [n * k for k in range(n, 0, -1)]
    cdp = cycles.live_activations("cdp", n, 6)
    steady = cdp[2 * n:2 * n * 5]
    assert set(steady) == {n * (n + 1) // 2} and max(cdp) == n * (n + 1) // 2
    if n == 4:
        assert cdp[:9] == [1, 2, 4, 6, 8, 9, 10, 10, 10]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_gradient_chunks_per_step(n):
    dp = cycles.chunks_per_step("dp", n, 2)
    assert dp[:2 * n] == [0] * n + [n] * n
    cdp = cycles.chunks_per_step("cdp", n, 5)
    steady = cdp[2 * n:2 * n * 4]
    assert set(steady) <= {n // 2, math.ceil(n / 2)} and max(cdp) == math.ceil(n / 2)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_rank_counts_and_mp_round_robin(n):
    assert roles.ranks_needed("mp", n, "cdp") == n * (n + 1) // 2
    assert roles.ranks_needed("mp", n, "dp") == n * n
    assert [roles.ranks_needed(m, n, "cdp") for m in ("single", "dp", "pp", "zero")] == \
        [1, n, n, n]
    ro = roles.make_roles("mp", n, "cdp", range(n * (n + 1) // 2))
    busy = {}  # a rank serves one micro-batch of its stage at a time
    for c in range(4):
        for i in range(n):
            for j in range(n):
                r = ro.rank_of(i, j, c)
                assert r in ro.blocks[j]
                f = cycles.step_of("cdp", n, "F", i, j, c)
                b = cycles.step_of("cdp", n, "B", i, j, c)
                for k in range(f, b + 1):
                    assert (r, k) not in busy, (r, k)
                    busy[(r, k)] = (i, j, c)


@pytest.mark.parametrize("mode", roles.MODES)
@pytest.mark.parametrize("rule", rules.RULES)
def test_every_dependency_goes_forward_in_key_order(mode, rule):
    """A value is made (or received) before it is read, by a task of smaller key: with every
    rank's chain and every pair's transfers in key order, no firing order deadlocks."""
    n = 4
    tl = rules.timeline_of(rule)
    ro = roles.make_roles(mode, n, tl, range(roles.ranks_needed(mode, n, tl)))
    made = {}
    tasks = []
    for c in range(4):
        works, moves = program.cycle_tasks(c, 2 * n * c, n, rule, ro)
        tasks += works + moves
    for t in tasks:
        if isinstance(t, program.Work):
            for v in t.makes:
                made[(t.rank, v)] = t.key
        else:
            made.setdefault((t.dst, t.payload), t.key)
    for t in tasks:
        reads = [(t.rank, v) for v in t.needs] if isinstance(t, program.Work) else \
            [(t.src, t.payload)]
        for where in reads:
            if where[1][0] == "paramb" and where[0] == ro.owner(where[1][1]):
                where = (where[0], ("param",) + where[1][1:])  # ZeRO: the owner's version
            if where[1][0] == "param" and where not in made:
                continue  # version 0, or one kept from an earlier cycle
            assert made[where] < t.key, (t, where)


def test_split_by_params_and_flops():
    sf.manual_seed(0)
    mlp = sf.nn.Sequential(sf.nn.Linear(64, 128), sf.nn.ReLU(), sf.nn.Linear(128, 128),
                           sf.nn.ReLU(), sf.nn.Linear(128, 64), sf.nn.ReLU(),
                           sf.nn.Linear(64, 10))
    for by in ("params", "flops"):
        stages = split_sequential(mlp, 4, by, torch.zeros(3, 64))
        assert [list(s._modules) for s in stages] == [["0", "1"], ["2", "3"], ["4", "5"],
                                                      ["6"]]
    wide = sf.nn.Sequential(*[sf.nn.Linear(8, 8) for _ in range(6)], sf.nn.Linear(8, 48))
    assert [len(s) for s in split_sequential(wide, 2)] == [6, 1]
    with pytest.raises(sf.errors.PlanError, match="cannot cut"):
        split_sequential(wide, 8)


def _conv_net():
    """4 convolutions, the feature map halved by each after the first: the FLOPs a conv are
    flat while its parameters grow 4x."""
    sf.manual_seed(0)
    return sf.nn.Sequential(sf.nn.Conv2d(3, 8, 3, padding=1), sf.nn.ReLU(),
                            sf.nn.Conv2d(8, 16, 3, stride=2, padding=1), sf.nn.ReLU(),
                            sf.nn.Conv2d(16, 32, 3, stride=2, padding=1), sf.nn.ReLU(),
                            sf.nn.Conv2d(32, 64, 3, stride=2, padding=1))


def test_split_by_flops_counts_output_positions():
    net, x = _conv_net(), torch.zeros(2, 3, 32, 32)
    # per sample, by hand: 2 x output elements x fan-in (in_channels x 3 x 3); ReLU its output
    conv = [2 * (8 * 32 * 32) * (3 * 9), 2 * (16 * 16 * 16) * (8 * 9),
            2 * (32 * 8 * 8) * (16 * 9), 2 * (64 * 4 * 4) * (32 * 9)]
    relu = [8 * 32 * 32, 16 * 16 * 16, 32 * 8 * 8]
    assert flop_weights(net, x) == [conv[0], relu[0], conv[1], relu[1], conv[2], relu[2],
                                    conv[3]]
    # units (conv + ReLU) weigh 450560, 593920, 591872, 589824 FLOPs; 224, 1168, 4640, 18496
    # parameters: the FLOP cut is 2 | 2 (max 1181696), the parameter cut 3 | 1
    cut = {by: [list(s._modules) for s in split_sequential(net, 2, by, x)]
           for by in ("params", "flops")}
    assert cut == {"params": [["0", "1", "2", "3", "4", "5"], ["6"]],
                   "flops": [["0", "1", "2", "3"], ["4", "5", "6"]]}
    # an Embedding is a lookup (0); a Linear on (batch, 5 tokens, 32): 2 x 5 x 256 x 32
    sf.manual_seed(0)
    lm = sf.nn.Sequential(sf.nn.Embedding(1000, 32), sf.nn.Linear(32, 256), sf.nn.ReLU())
    assert flop_weights(lm, torch.zeros(4, 5, dtype=torch.long)) == [0, 2 * 5 * 256 * 32,
                                                                     5 * 256]
    with pytest.raises(sf.errors.PlanError, match="needs example_input="):
        split_sequential(net, 2, "flops")

    def trainer_stages():
        t = CyclicDataParallel(_conv_net(), lambda o, y: o.sum(),
                               lambda ps: sf.optim.SGD(ps, lr=1.0),
                               split=(2, "flops"), example_input=x)
        return [list(r.module._modules) for r in t.runners]
    assert sf.launch(trainer_stages, world_size=1)[0] == cut["flops"]


def test_tied_weights_across_stages_are_refused():
    """A module or a parameter in two stages would become two (each stage has versions and
    an optimizer of its own): refused, naming the stages and the parameter."""
    def build(stages, **kw):
        def fn():
            CyclicDataParallel(stages(), lambda o, y: o.sum(), lambda ps: sf.optim.SGD(ps, lr=1.0),
                               rule="dp", **kw)
        sf.launch(fn, world_size=1)

    def same_module():
        sf.manual_seed(0)
        shared = sf.nn.Sequential(sf.nn.Linear(4, 4), sf.nn.Tanh())
        return [shared, shared, sf.nn.Linear(4, 2)]

    def same_parameter():
        sf.manual_seed(0)
        a, b = sf.nn.Linear(4, 4), sf.nn.Linear(4, 4)
        b.weight = a.weight
        return sf.nn.Sequential(a, sf.nn.Tanh(), sf.nn.Linear(4, 4), b)
    with pytest.raises(sf.errors.PlanError, match=r"stages 0 and 1 share .*'0.weight'.*not supported"):
        build(same_module)
    with pytest.raises(sf.errors.PlanError, match=r"stages 0 and 2 share .*'0.weight' is stage 2's "
                                           r"'3.weight', shape \(4, 4\)"):
        build(same_parameter, split=3)
    with pytest.raises(sf.errors.PlanError, match="stages 0 and 1 share"):
        sf.launch(lambda: sf.parallel.cdp.closed_form(same_module(), None, None, "dp", []),
                  world_size=1)


def test_bad_arguments_name_the_fix():
    with pytest.raises(sf.errors.PlanError, match="one of"):
        rules.version("v3", 0, 0, 0, 4)
    with pytest.raises(sf.errors.PlanError, match="needs 10 distinct ranks"):
        roles.make_roles("mp", 4, "cdp", range(4))
    with pytest.raises(sf.errors.PlanError, match="N >= 2"):
        cycles.ops("cdp", 1, 1)
