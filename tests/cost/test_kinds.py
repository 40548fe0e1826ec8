"""Per-kind collective fits, strided-copy and per-step costs: formulas, fits, files, evaluate."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

import sbpflow as sf
from sbpflow.auto.evaluate import redistribution, redistribution_steps
from sbpflow.cost import Cluster, CostError, Link, plan_time, step_time
from sbpflow.cost.calibrate import MEASURED_KINDS, fit_collective, fit_copy
from sbpflow.cost.cluster import CollectiveFit

B, P, S = sf.B, sf.P, sf.S
A, BETA = 1e-6, 1e-9
AG = (2e-6, 3e-9, 5e-5)          # all_gather fit on intra: alpha, beta, overhead
AR = (1e-6, 2e-9, 0.0, "direct")
P2P = (4e-6, 2e-9, 1e-4)


def fitted(copy_beta: float = 0.0, step_overhead: float = 0.0, p: int = 4) -> Cluster:
    return Cluster(1, p, intra=(A, BETA), inter=(1.0, 1.0),
                   kinds={"intra": {"all_gather": AG, "p2p": P2P}, "inter": {"all_reduce": AR}},
                   copy_beta=copy_beta, step_overhead=step_overhead)


def test_per_kind_fit_is_used_and_others_keep_the_link():
    c = fitted()
    n = 4000
    # all_gather on 4 ranks: o + 3 a + 3/4 n b with the kind's own numbers
    assert c.collective_time("all_gather", n, range(4)) == pytest.approx(
        5e-5 + 3 * 2e-6 + 0.75 * n * 3e-9)
    # all_reduce has no fit: the link's 2(p-1) a + 2(p-1)/p n b, no overhead
    assert c.collective_time("all_reduce", n, range(4)) == pytest.approx(6 * A + 1.5 * n * BETA)
    assert c.fit("all_reduce", [0, 1]) == CollectiveFit(A, BETA, 0.0)
    assert c.collective_time("p2p", n, (0, 1)) == pytest.approx(1e-4 + 4e-6 + n * 2e-9)
    assert c.collective_time("all_gather", n, [2]) == 0.0  # one rank: still free
    # a cluster without kinds is exactly the plain alpha-beta model
    plain = Cluster(1, 4, intra=(A, BETA))
    assert plain.collective_time("all_gather", n, range(4)) == \
        pytest.approx(3 * A + 0.75 * n * BETA)
    # inter-node groups use the inter class's fits (none here: the inter link)
    two = Cluster(2, 2, intra=(A, BETA), inter=(1e-5, 1e-8), kinds={"intra": {"all_gather": AG}})
    assert two.collective_time("all_gather", n, [0, 2]) == pytest.approx(1e-5 + 0.5 * n * 1e-8)
    assert two.collective_time("all_gather", n, [0, 1]) == pytest.approx(
        5e-5 + 2e-6 + 0.5 * n * 3e-9)


def test_cluster_validation_hash_and_file_roundtrip(tmp_path):
    c = fitted(copy_beta=2e-10, step_overhead=3e-5)
    assert c == fitted(copy_beta=2e-10, step_overhead=3e-5)
    assert hash(c) == hash(fitted(copy_beta=2e-10, step_overhead=3e-5))
    assert c != fitted()
    c.save(tmp_path / "c.json")
    d = Cluster.load(tmp_path / "c.json")
    assert d == c and d.kinds_table["intra"]["all_gather"] == CollectiveFit(*AG)
    assert d.kinds_table["inter"]["all_reduce"] == CollectiveFit(*AR)
    assert d.copy_beta == 2e-10 and d.step_overhead == 3e-5
    # files without the new keys (older format) load as the plain model
    raw = json.loads((tmp_path / "c.json").read_text())
    for k in ("kinds", "copy_beta", "step_overhead"):
        del raw[k]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    old = Cluster.load(tmp_path / "old.json")
    assert old.kinds == () and old.copy_beta == 0.0 and old.step_overhead == 0.0
    for bad in (dict(kinds={"intra": {"gather": AG}}), dict(kinds={"node": {"p2p": AG}}),
                dict(kinds={"intra": {"p2p": (1e-6, -1e-9)}}), dict(kinds={"intra": {"p2p": (1,)}}),
                dict(copy_beta=-1.0), dict(step_overhead=float("nan"))):
        with pytest.raises(CostError):
            Cluster(1, 4, **bad)


# -- fitting --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", MEASURED_KINDS)
@pytest.mark.parametrize("alpha, beta, overhead", [(5e-5, 1e-9, 2e-4), (2e-6, 4e-12, 1e-5),
                                                   (1e-3, 2.5e-9, 0.0)])
def test_fit_collective_recovers_parameters_from_noisy_synthetic_timings(kind, alpha, beta,
                                                                         overhead):
    rng = random.Random(1)
    fit = CollectiveFit(alpha, beta, overhead)
    groups = (2, 4, 8)
    want = fit
    samples = []
    for p in groups:
        for n in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 24):
            t = sf.cost.collective_time(kind, n, p, fit)
            for _ in range(2):
                samples.append((kind, p, n, t * (1 + rng.gauss(0, 0.01))))
    got, res = fit_collective(samples)
    assert got.alpha == pytest.approx(want.alpha, rel=0.05)
    assert got.beta == pytest.approx(want.beta, rel=0.05)
    if want.overhead:
        assert got.overhead == pytest.approx(want.overhead, rel=0.05)
    else:
        assert got.overhead < 0.05 * (want.alpha + want.overhead)
    assert len(res) == len(samples)
    exact = [(k, p, n, sf.cost.collective_time(k, n, p, fit)) for k, p, n, _ in samples]
    got, res = fit_collective(exact)
    assert max(abs(r) / t for (_, _, _, t), r in zip(exact, res)) < 1e-9


def test_fit_collective_errors_and_constraints():
    with pytest.raises(CostError, match="one kind"):
        fit_collective([("all_gather", 2, 100, 1e-3), ("all_reduce", 2, 1000, 2e-3)])
    with pytest.raises(CostError, match="two group sizes"):
        fit_collective([("all_gather", 2, 100, 1e-3), ("all_gather", 2, 1000, 2e-3)],
                       overhead=True)
    with pytest.raises(CostError, match="apart"):
        fit_collective([("all_gather", 2, 100, 1e-3), ("all_gather", 2, 100, 2e-3)])
    # time falling with size: beta clamped at 0, never negative
    f, _ = fit_collective([("all_gather", 2, 100, 2e-3), ("all_gather", 2, 10**6, 1e-3),
                           ("all_gather", 4, 100, 2e-3), ("all_gather", 4, 10**6, 1e-3)])
    assert f.beta == 0.0 and min(f[:3]) >= 0 and f.alpha + f.overhead > 0
    # constant time over group sizes: all overhead, no per-message alpha
    f, _ = fit_collective([("all_to_all", p, n, 1e-3 + sf.cost.volume("all_to_all", n, p) * 1e-9)
                           for p in (2, 4, 8) for n in (1000, 10**6)])
    assert f.overhead == pytest.approx(1e-3) and f.alpha == pytest.approx(0, abs=1e-12)
    assert f.beta == pytest.approx(1e-9)


def test_direct_all_reduce_variant_formula_and_step_time():
    """direct all-reduce: (p-1) a + (p-1) n b (every rank reduces every rank's tensor)."""
    fit = CollectiveFit(1e-6, 1e-9, 1e-5, "direct")
    assert sf.cost.collective_time("all_reduce", 4000, 4, fit) == pytest.approx(
        1e-5 + 3e-6 + 3 * 4000 * 1e-9)
    assert sf.cost.collective_time("all_reduce", 4000, 4, fit[:3]) == pytest.approx(
        1e-5 + 6e-6 + 1.5 * 4000 * 1e-9)  # the ring
    c = Cluster(1, 4, intra=(A, BETA), kinds={"intra": {"all_reduce": fit}})
    pl = sf.placement("cpu", ranks=[0, 1, 2, 3])
    (st,) = sf.boxing.plan((8, 16), torch.float32, src=(pl, P), dst=(pl, B)).steps
    assert step_time(st, c) == pytest.approx(1e-5 + 3e-6 + 3 * 512 * 1e-9)
    with pytest.raises(CostError, match="algorithm"):
        Cluster(1, 4, kinds={"intra": {"all_reduce": (1e-6, 1e-9, 0.0, "tree")}})
    with pytest.raises(CostError, match="variant"):
        sf.cost.collective_time("all_gather", 10, 2, (1e-6, 1e-9, 0.0, "direct"))


@pytest.mark.parametrize("algorithm", ["", "direct"])
def test_fit_collective_picks_the_all_reduce_algorithm_that_ran(algorithm):
    rng = random.Random(3)
    fit = CollectiveFit(2e-5, 1e-9, 1e-4, algorithm)
    samples = [("all_reduce", p, n, sf.cost.collective_time("all_reduce", n, p, fit)
                * (1 + rng.gauss(0, 0.02)))
               for p in (2, 4, 8) for n in (1 << 12, 1 << 16, 1 << 20, 1 << 22)]
    got, _ = fit_collective(samples)
    assert got.algorithm == algorithm
    assert got.beta == pytest.approx(1e-9, rel=0.05)
    # with one group size the volumes cannot be told apart: the default formula
    got, _ = fit_collective([s for s in samples if s[1] == 4])
    assert got.algorithm == ""


BENT = CollectiveFit(3e-5, 1e-9, 2e-4, "", 2e-9, 3 * (1 << 18))  # 3x steeper past 768 KiB


def test_bent_fit_prices_bytes_past_the_knee_at_the_extra_rate():
    # all_gather of n = 4 MiB on 4 ranks: v = 3 MiB per rank, 2.25 MiB of it past the knee
    n, v = 1 << 22, 3 * (1 << 20)
    want = 2e-4 + 3 * 3e-5 + v * 1e-9 + (v - 3 * (1 << 18)) * 2e-9
    assert BENT.time(3, v) == pytest.approx(want)
    assert sf.cost.collective_time("all_gather", n, 4, BENT) == pytest.approx(want)
    # below the knee the line is straight
    assert sf.cost.collective_time("all_gather", 1 << 16, 4, BENT) == pytest.approx(
        2e-4 + 9e-5 + 0.75 * (1 << 16) * 1e-9)
    c = Cluster(1, 4, intra=(A, BETA), kinds={"intra": {"all_gather": BENT}})
    pl = sf.placement("cpu", ranks=[0, 1, 2, 3])
    (st,) = sf.boxing.plan((1 << 20,), torch.float32, src=(pl, S(0)), dst=(pl, B)).steps
    assert step_time(st, c) == pytest.approx(want)       # the planner's step, same price
    assert redistribution((1 << 20,), (4,), (S(0),), (4,), (B,), 4, c)[0] == \
        pytest.approx(want)                              # and evaluate's
    assert Cluster.from_dict(c.to_dict()) == c           # the bend survives a file
    for bad in ((1e-6, 1e-9, 0.0, "", -1e-9, 10.0), (1e-6, 1e-9, 0.0, "", 1e-9, float("nan"))):
        with pytest.raises(CostError, match="beta2|knee"):
            Cluster(1, 4, kinds={"intra": {"all_gather": bad}})


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all"])
def test_fit_collective_finds_a_bend_the_samples_show(kind):
    rng = random.Random(4)
    true = BENT._replace(knee=sf.cost.volume(kind, 1 << 20, 4))  # a sampled volume
    sizes = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
    samples = [(kind, p, n, sf.cost.collective_time(kind, n, p, true) * (1 + rng.gauss(0, 0.02)))
               for p in (2, 4) for n in sizes]
    got, res = fit_collective(samples, algorithms=())
    assert got.knee == true.knee and got.beta2 == pytest.approx(true.beta2, rel=0.1)
    for (_, p, n, t), r in zip(samples, res):  # the bent fit follows every sample
        assert abs(r) / t < 0.06
    straight, res0 = fit_collective(samples, algorithms=(), bend=False)
    assert straight.beta2 == 0 and max(abs(r) / s[3] for s, r in zip(samples, res0)) > 0.3
    # p2p never bends by default (a transfer prices its messages one by one)
    p2p = [("p2p",) + s[1:] for s in samples]
    assert fit_collective(p2p)[0].beta2 == 0


def test_fit_collective_rarely_bends_straight_samples_and_then_harmlessly():
    # 2 % noise on a straight line: a bend is kept for about one fit in ten (the criterion's
    # price), and whether bent or not the fit prices the sampled range and twice the largest
    # message as well as a straight fit does
    truth = CollectiveFit(2e-5, 1e-9, 1e-4)
    sizes = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
    bent, worst = 0, {None: 0.0, False: 0.0}
    for seed in range(40):
        rng = random.Random(seed)
        samples = [("all_gather", p, n, sf.cost.collective_time("all_gather", n, p, truth)
                    * (1 + rng.gauss(0, 0.02))) for p in (2, 4) for n in sizes]
        for bend in (None, False):
            got, _ = fit_collective(samples, bend=bend)
            bent += got.beta2 > 0
            worst[bend] = max(worst[bend], *(
                abs(sf.cost.collective_time("all_gather", n, p, got)
                    / sf.cost.collective_time("all_gather", n, p, truth) - 1)
                for p in (2, 4) for n in sizes + (1 << 23,)))
    assert 0 < bent <= 8, bent
    assert worst[None] < 0.06 and worst[None] < 1.5 * worst[False], worst


def test_fit_copy_recovers_copy_beta():
    rng = random.Random(2)
    samples = [(n, (2e-5 + n * 3e-10) * (1 + rng.gauss(0, 0.01)))
               for n in (1 << 14, 1 << 18, 1 << 20, 1 << 22) for _ in range(3)]
    beta, c = fit_copy(samples)
    assert beta == pytest.approx(3e-10, rel=0.05) and c == pytest.approx(2e-5, rel=0.1)
    with pytest.raises(CostError):
        fit_copy([(100, 1e-3), (100, 2e-3)])


# -- steps: copies, overheads ---------------------------------------------------------------------
def test_step_time_charges_strided_copies_and_step_overhead():
    cb, so = 5e-10, 2e-5
    c = fitted(copy_beta=cb, step_overhead=so)
    pl = sf.placement("cpu", ranks=[0, 1, 2, 3])
    shape, nb = (8, 16), 8 * 16 * 4
    # reduce-scatter to S(1): each rank cuts its (8, 16) input into column blocks (strided)
    (s,) = sf.boxing.plan(shape, torch.float32, src=(pl, P), dst=(pl, S(1))).steps
    assert s.kind == "reduce_scatter"
    assert step_time(s, c) == pytest.approx(so + 3 * A + 0.75 * nb * BETA + nb * cb)
    # to S(0): row blocks are contiguous, no copy
    (s,) = sf.boxing.plan(shape, torch.float32, src=(pl, P), dst=(pl, S(0))).steps
    assert step_time(s, c) == pytest.approx(so + 3 * A + 0.75 * nb * BETA)
    # all-gather of S(1): the (8, 16) output is assembled through strided column views
    (s,) = sf.boxing.plan(shape, torch.float32, src=(pl, S(1)), dst=(pl, B)).steps
    assert step_time(s, c) == pytest.approx(so + 5e-5 + 3 * 2e-6 + 0.75 * nb * 3e-9 + nb * cb)
    (s,) = sf.boxing.plan(shape, torch.float32, src=(pl, S(0)), dst=(pl, B)).steps
    assert step_time(s, c) == pytest.approx(so + 5e-5 + 3 * 2e-6 + 0.75 * nb * 3e-9)
    # a local step costs only the step overhead
    (s,) = sf.boxing.plan(shape, torch.float32, src=(pl, B), dst=(pl, S(1))).steps
    assert s.kind == "local" and step_time(s, c) == pytest.approx(so)


def test_transfer_pays_the_p2p_overhead_once():
    c = fitted()
    src = sf.placement("cpu", ranks=[0, 1])
    p = sf.boxing.plan((8, 4), torch.float32, src=(src, S(0)),
                       dst=(sf.placement("cpu", ranks=[2]), B))
    (s,) = p.steps
    assert s.kind == "transfer"
    # rank 2 receives two 64-byte messages in one exchange: o + 2 (a + 64 b)
    assert step_time(s, c) == pytest.approx(1e-4 + 2 * (4e-6 + 64 * 2e-9))
    # and writes the 128 bytes into its output shard: a copy
    cb = 5e-10
    assert step_time(s, fitted(copy_beta=cb)) == pytest.approx(
        1e-4 + 2 * (4e-6 + 64 * 2e-9) + 128 * cb)


# -- evaluate prices what boxing does ------------------------------------------------------------
def test_evaluate_copy_terms_match_hand_values():
    cb = 5e-10
    c = fitted(copy_beta=cb)
    shape, nb = (8, 16), 8 * 16 * 4
    t, _ = redistribution(shape, (4,), (P,), (4,), (S(1),), 4, c)
    assert t == pytest.approx(3 * A + 0.75 * nb * BETA + nb * cb)
    t, _ = redistribution(shape, (4,), (P,), (4,), (S(0),), 4, c)
    assert t == pytest.approx(3 * A + 0.75 * nb * BETA)
    t, _ = redistribution(shape, (4,), (S(1),), (4,), (B,), 4, c)
    assert t == pytest.approx(5e-5 + 3 * 2e-6 + 0.75 * nb * 3e-9 + nb * cb)
    # S(0) -> S(1): the (2, 16) shard is cut into column blocks (strided); the received pieces
    # are row blocks of the (8, 4) output (axis 0 leads: contiguous)
    t, _ = redistribution(shape, (4,), (S(0),), (4,), (S(1),), 4, c)
    local = nb // 4
    assert t == pytest.approx(3 * A + 0.75 * local * BETA + local * cb)


NESTED = [
    ((2, 2), (P, S(0)), (S(0), S(0))),
    ((2, 2), (S(0), S(0)), (B, S(0))),
    ((2, 2), (B, S(0)), (S(0), S(0))),
    ((2, 2), (S(0), S(0)), (P, S(0))),
    ((2, 2, 2), (S(0), S(1), B), (S(0), B, S(1))),
    ((2, 4), (S(0), S(0)), (B, S(0))),
]


def _mesh_placement(mesh: tuple):
    """A cpu placement of ranks 0.. in row-major order on ``mesh``, and its rank count."""
    world = math.prod(mesh)
    return sf.placement("cpu", ranks=torch.arange(world).reshape(mesh).tolist()), world


def _nested_case(mesh, src, dst):
    pl, world = _mesh_placement(mesh)
    c = fitted(p=world, copy_beta=1e-10, step_overhead=1e-5)
    shape = (64, 48)
    return c, shape, sf.boxing.plan(shape, torch.float32, src=(pl, src), dst=(pl, dst))


@pytest.mark.parametrize("mesh, src, dst", NESTED)
def test_nested_split_moves_are_priced_as_the_planners_transfer(mesh, src, dst):
    """Moves the fixed order cannot make as single steps (one axis split on two mesh dims) are
    not free or cheap collectives: evaluate prices the planner's transfer (partials reduced on
    the source devices, then every rank receives what it lacks, one message per overlapping
    source region), equal to the planner's plan priced by plan_time."""
    c, shape, plan = _nested_case(mesh, src, dst)
    assert any(s.kind == "transfer" for s in plan.steps)
    assert "transfer" in [k for k, *_ in redistribution_steps(shape, mesh, src, mesh, dst)]
    t, _ = redistribution(shape, mesh, src, mesh, dst, 4, c)
    assert t == pytest.approx(plan_time(plan, c), rel=1e-9)
    plain = Cluster(1, c.world_size, intra=(A, BETA))
    assert redistribution(shape, mesh, src, mesh, dst, 4, plain)[0] > 0


def test_nested_moves_above_the_enumeration_limit_keep_their_collective():
    """On more than 256 ranks a nested move is priced as the collective of the fixed order (an
    all-gather here: each rank lacks 15/16 of its 1/32 row block), not as a cheaper kind."""
    shape, mesh, itemsize = (4096, 1024), (16, 32), 4
    c = Cluster(16, 32, intra=(A, BETA), inter=(A, BETA))
    _, moved = redistribution(shape, mesh, (S(0), S(0)), mesh, (B, S(0)), itemsize, c)
    numel = 4096 * 1024
    assert moved == pytest.approx(15 / 16 * numel / 32 * itemsize)
    # the same move on 4 x 8 ranks, priced by the exact transfer: rank (0, 1) holds row block
    # 1 of 32 and wants block 1 of 8 (rows 4..7 of 32), none of which it holds
    _, small = redistribution(shape, (4, 8), (S(0), S(0)), (4, 8), (B, S(0)), itemsize,
                              Cluster(4, 8, intra=(A, BETA), inter=(A, BETA)))
    assert small == pytest.approx(numel / 8 * itemsize)


def test_transfer_into_partial_max_is_received_by_every_rank():
    """A non-first rank of a P(sum) destination holds zeros (receives nothing); of P(max) it
    holds a copy, so the busiest receiver is the same as for B."""
    from sbpflow.auto.redistribution_price import _transfer
    fine, shape = (2, 2), (8, 8)
    as_b = _transfer(shape, fine, (S(0), S(0)), (B, S(1)))
    as_max = _transfer(shape, fine, (S(0), S(0)), (sf.P("max"), S(1)))
    as_sum = _transfer(shape, fine, (S(0), S(0)), (P, S(1)))
    assert as_max == as_b and as_sum[0] <= as_b[0]
    assert _transfer(shape, fine, (S(0), S(0)), (P, B))[0] == 48  # rank (0, *) lacks 3/4


@pytest.mark.parametrize("mesh, src, dst", [
    ((4,), (P,), (P("max"),)), ((4,), (P("max"),), (P,)),
    ((2, 2), (P, P), (P("max"), P("max"))), ((2, 2), (P, B), (P("max"), B)),
])
def test_evaluate_reduces_a_partial_before_changing_its_reduction(mesh, src, dst):
    """No local step turns P(sum) into P(max) (the boxing rule `is_local_change`): the planner
    reduce-scatters first, and evaluate prices that, not a free local step."""
    pl, world = _mesh_placement(mesh)
    shape = (8, 16)
    plan = sf.boxing.plan(shape, torch.float32, src=(pl, src), dst=(pl, dst))
    assert [s.kind for s in plan.steps if s.kind != "local"] == ["reduce_scatter"]
    assert [k for k, *_ in redistribution_steps(shape, mesh, src, mesh, dst)] == \
        ["reduce_scatter"]
    c = Cluster(1, world, intra=(A, BETA))
    t, per_device = redistribution(shape, mesh, src, mesh, dst, 4, c)
    assert per_device * world == plan.nbytes > 0
    assert t == pytest.approx(plan_time(plan, c), rel=1e-12)


# -- calibration of the refinements ---------------------------------------------------------------
def _calibrate_with_slow_step():
    import time
    return sf.cost.calibrate(sizes=(4096, 65536), repeats=1, inner=1,
                             step=lambda: time.sleep(0.003))


def test_calibrate_fits_kinds_copy_and_a_given_step():
    out = sf.launch(_calibrate_with_slow_step, 4)
    cluster, report = out[0]
    assert all(c == cluster for c, _ in out)  # every rank agrees, kinds included
    assert report.step_overhead >= 0.003 and cluster.step_overhead == report.step_overhead
    table = cluster.kinds_table["intra"]
    assert set(table) == set(MEASURED_KINDS)
    # group sizes 2 and 4: overheads fitted (>= 0), p2p's too (exchanges with 1 and 3 peers)
    assert all(min(f[:3]) >= 0 for f in table.values())
    assert table["all_reduce"].algorithm == ""  # variants are off by default
    assert len(report.copy_samples) == 2 and cluster.copy_beta == report.copy_beta >= 0
    for s in report.samples:   # residuals are those of the model the cluster prices with
        assert s.predicted == pytest.approx(
            sf.cost.collective_time(s.kind, s.nbytes, s.p, cluster.fit(s.kind, range(s.p))))
