"""The cost model: alpha-beta formulas, link selection, step and plan times, calibration."""

from __future__ import annotations

import argparse
import json
import math
import random

import pytest
import torch

import sbpflow as sf
from sbpflow.cost import Cluster, CostError, Link, fit_alpha_beta, plan_time, step_time
from sbpflow.cost.calibrate import MEASURED_KINDS, _calibrate_rank, calibrate_command
from sbpflow.cost.calibrate import main as calibrate_main

A, BETA = 1e-6, 1e-9  # one link for the hand-computed values


def one_node(p: int = 8) -> Cluster:
    return Cluster(nodes=1, devices_per_node=p, intra=(A, BETA), inter=(1.0, 1.0))


def two_nodes() -> Cluster:
    """2 nodes x 4 devices; inter-node is 10x slower in both terms."""
    return Cluster(nodes=2, devices_per_node=4, intra=(1e-6, 1e-10), inter=(1e-5, 1e-9))


# -- formulas -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, expected", [
    ("all_gather", 3 * A + 0.75 * 4000 * BETA),       # (p-1)a + (p-1)/p n b = 6 us
    ("reduce_scatter", 3 * A + 0.75 * 4000 * BETA),
    ("all_to_all", 3 * A + 0.75 * 4000 * BETA),
    ("all_reduce", 6 * A + 1.5 * 4000 * BETA),        # 2(p-1)a + 2(p-1)/p n b = 12 us
    ("broadcast", 2 * (A + 4000 * BETA)),             # small: binomial, log2(4) = 2 levels
])
def test_formulas_hand_computed(kind, expected):
    c = one_node()
    assert c.collective_time(kind, 4000, ranks=[0, 1, 2, 3]) == pytest.approx(expected)


def test_formula_values_and_edge_cases():
    c = one_node()
    assert c.collective_time("all_gather", 4000, [0, 1, 2, 3]) == pytest.approx(6e-6)
    assert c.collective_time("all_reduce", 4000, [0, 1, 2, 3]) == pytest.approx(12e-6)
    assert c.collective_time("p2p", 4000, (0, 5)) == pytest.approx(A + 4000 * BETA)
    # an exchange among 4: each rank sends a message to each of the 3 others
    assert c.collective_time("p2p", 4000, [0, 1, 2, 3]) == pytest.approx(3 * (A + 4000 * BETA))
    # large broadcast: scatter + ring all-gather, (log2 p + p - 1) a + 2 (p-1)/p n b
    n = 4_000_000
    assert c.collective_time("broadcast", n, range(4)) == pytest.approx(5 * A + 1.5 * n * BETA)
    assert c.collective_time("broadcast", n, range(4)) < 2 * (A + n * BETA)
    # 8 ranks all-reduce, 1 MiB: 14 a + 1.75 n b
    assert c.collective_time("all_reduce", 2**20, range(8)) == pytest.approx(
        14 * A + 1.75 * 2**20 * BETA)
    for kind in sf.cost.KINDS:
        assert c.collective_time(kind, 10**6, [3]) == 0.0  # one rank: nothing to do
    with pytest.raises(CostError, match="unknown collective"):
        c.collective_time("gather", 10, [0, 1])
    with pytest.raises(sf.SbpError):
        c.collective_time("all_gather", 10, [0, 99])  # rank outside the cluster


# -- cluster --------------------------------------------------------------------------------------
def test_intra_inter_link_selection():
    c = two_nodes()
    assert c.world_size == 8 and [c.node_of(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert c.link([0, 1, 2, 3]) == c.intra == Link(1e-6, 1e-10)
    assert c.link([4, 7]) == c.intra
    assert c.link([3, 4]) == c.inter == Link(1e-5, 1e-9)
    assert c.link(range(8)) == c.inter
    n = 8000
    assert c.collective_time("all_gather", n, [0, 1]) == pytest.approx(1e-6 + 0.5 * n * 1e-10)
    assert c.collective_time("all_gather", n, [0, 4]) == pytest.approx(1e-5 + 0.5 * n * 1e-9)
    with pytest.raises(CostError, match="outside"):
        c.node_of(8)


def test_mesh_dims_map_to_hierarchy():
    """On a 2x4 mesh [[0..3], [4..7]], mesh dim 1 is inside a node and dim 0 across nodes."""
    c = two_nodes()
    mesh = sf.placement("cpu", ranks=[[0, 1, 2, 3], [4, 5, 6, 7]])
    nb = 8 * 16 * 4  # (8, 16) float32
    inner = sf.boxing.plan((8, 16), torch.float32, src=(mesh, (sf.B, sf.S(0))),
                           dst=(mesh, (sf.B, sf.B)))
    (s,) = inner.steps
    assert (s.kind, s.dims) == ("all_gather", (1,))
    assert step_time(s, c) == pytest.approx(3 * 1e-6 + 0.75 * nb * 1e-10)
    assert step_time(s, c) == pytest.approx(c.collective_time("all_gather", nb, [0, 1, 2, 3]))
    outer = sf.boxing.plan((8, 16), torch.float32, src=(mesh, (sf.S(0), sf.B)),
                           dst=(mesh, (sf.B, sf.B)))
    (s,) = outer.steps
    assert (s.kind, s.dims) == ("all_gather", (0,))
    assert step_time(s, c) == pytest.approx(1e-5 + 0.5 * nb * 1e-9)
    # a 1-D placement inside node 1 is all intra
    pl = sf.placement("cpu", ranks=[4, 5, 6, 7])
    p = sf.boxing.plan((8, 16), torch.float32, src=(pl, sf.P), dst=(pl, sf.B))
    assert plan_time(p, c) == pytest.approx(6 * 1e-6 + 1.5 * nb * 1e-10)


def test_presets_and_validation():
    dgx = Cluster.preset("dgx-a100", nodes=2)
    assert (dgx.nodes, dgx.devices_per_node, dgx.world_size) == (2, 8, 16)
    assert dgx.memory_per_device == 80 * 2**30 and dgx.flops_per_device == 312e12
    assert dgx.inter.bandwidth == pytest.approx(12.5e9)  # 100 Gb/s
    assert dgx.intra.bandwidth > 10 * dgx.inter.bandwidth  # NVLink
    assert dgx.link(range(8)) == dgx.intra and dgx.link([7, 8]) == dgx.inter
    sc = Cluster.preset("supercomputer", nodes=64)
    assert (sc.world_size, sc.devices_per_node) == (64, 1)
    assert sc.link([0, 1]) == sc.inter and sc.collective_time("all_reduce", 1e6, [5]) == 0.0
    assert Cluster.preset("dgx-a100", nodes=1, memory_per_device=40 * 2**30).memory_per_device \
        == 40 * 2**30
    assert sc.compute_time(18.7e12) == pytest.approx(1.0)
    with pytest.raises(CostError, match="unknown cluster preset"):
        Cluster.preset("nope")
    # no flops_per_device: the documented default device speed, never free
    assert Cluster(nodes=1, devices_per_node=2).compute_time(1e12) == \
        pytest.approx(1e12 / sf.cost.DEFAULT_FLOPS_PER_DEVICE)
    assert Cluster(1, 2, flops_per_device=1e12, compute_efficiency=0.5).compute_time(1e12) == \
        pytest.approx(2.0)
    with pytest.raises(CostError, match="compute_efficiency"):
        Cluster(1, 2, compute_efficiency=1.5)
    for bad in (dict(nodes=0), dict(devices_per_node=1.5), dict(intra=(1e-6,)),
                dict(inter=(-1, 1e-9)), dict(memory_per_device=0)):
        with pytest.raises(sf.SbpError):
            Cluster(**bad)


def test_save_load_roundtrip(tmp_path):
    c = Cluster.preset("dgx-a100", nodes=2, compute_efficiency=0.45)
    c.save(tmp_path / "c.json", extra={"note": 1})
    d = Cluster.load(tmp_path / "c.json")
    assert d == c and hash(d) == hash(c) and d.name == "dgx-a100" and d.compute_efficiency == 0.45
    assert json.loads((tmp_path / "c.json").read_text())["calibration"] == {"note": 1}
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(CostError):
        Cluster.load(tmp_path / "bad.json")
    with pytest.raises(CostError):
        Cluster.load(tmp_path / "missing.json")


# -- steps and plans ------------------------------------------------------------------------------
def test_plan_time_is_sum_of_steps():
    c = two_nodes()
    mesh = sf.placement("cpu", ranks=[[0, 1, 2, 3], [4, 5, 6, 7]])
    seen_multi = False
    for src, dst in [((sf.P, sf.S(0)), (sf.S(1), sf.B)), ((sf.S(0), sf.P), (sf.B, sf.S(1))),
                     ((sf.S(0), sf.S(1)), (sf.S(1), sf.S(0))), ((sf.P, sf.P), (sf.B, sf.B)),
                     ((sf.B, sf.S(1)), (sf.S(0), sf.B))]:
        p = sf.boxing.plan((12, 20), torch.float32, src=(mesh, src), dst=(mesh, dst))
        times = [step_time(s, c) for s in p.steps]
        seen_multi |= len(p.steps) > 1
        assert plan_time(p, c) == pytest.approx(sum(times))
        assert plan_time(p.steps, c) == pytest.approx(sum(times))
        assert all(t == 0 for s, t in zip(p.steps, times) if s.kind == "local")
        assert all(t > 0 for s, t in zip(p.steps, times) if s.kind != "local")
    assert seen_multi
    eq = sf.boxing.plan((4, 4), torch.float32, src=(mesh, (sf.B, sf.B)), dst=(mesh, (sf.B, sf.B)))
    assert plan_time(eq, c) == 0.0


def test_uneven_shards_use_the_busiest_rank():
    c = one_node(2)
    pl = sf.placement("cpu", ranks=[0, 1])
    p = sf.boxing.plan((5,), torch.float32, src=(pl, sf.S(0)), dst=(pl, sf.B))
    (s,) = p.steps
    # pieces of 3 and 2 floats: rank 0 sends 12 B, receives 8 B -> 12 B on the busiest rank
    assert step_time(s, c) == pytest.approx(A + 12 * BETA)
    assert s.nbytes == 20  # bytes summed over ranks (the planner's cost), unchanged


def test_transfer_step_time():
    c = two_nodes()
    src = sf.placement("cpu", ranks=[0, 1])
    dst = sf.placement("cpu", ranks=[4, 5])
    p = sf.boxing.plan((8, 4), torch.float32, src=(src, sf.S(0)), dst=(dst, sf.S(0)))
    (s,) = p.steps
    assert s.kind == "transfer"
    # two 64-byte inter-node messages 0->4 and 1->5, in parallel
    assert step_time(s, c) == pytest.approx(1e-5 + 64 * 1e-9)
    # gather onto one rank: 4 receives on rank 0 (2 intra, 2 inter), serialised on the receiver
    p = sf.boxing.plan((8, 4), torch.float32, src=(sf.placement("cpu", ranks=[0, 1, 4, 5]),
                                                   sf.S(0)),
                       dst=(sf.placement("cpu", ranks=[2]), sf.B))
    (s,) = p.steps
    msgs = [(a, b, 32) for a, b, _ in s.routes if a != b]
    assert len(msgs) == 4
    expected = sum(c.collective_time("p2p", n, (a, b)) for a, b, n in msgs)
    assert expected == pytest.approx(2 * (1e-6 + 32e-10) + 2 * (1e-5 + 32e-9))
    assert step_time(s, c) == pytest.approx(expected)


# -- fitting --------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha, beta", [(5e-5, 1e-9), (2e-6, 4e-12), (1e-3, 2.5e-9)])
def test_fit_recovers_alpha_beta_from_noisy_synthetic_timings(alpha, beta):
    rng = random.Random(0)
    link = Link(alpha, beta)
    samples = []
    for kind in MEASURED_KINDS:
        for p in (2, 4, 8):
            for n in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 24):
                t = sf.cost.collective_time(kind, n, p, link)
                samples.append((kind, p, n, t * (1 + rng.gauss(0, 0.03))))
    a, b, res = fit_alpha_beta(samples)
    assert a == pytest.approx(alpha, rel=0.05) and b == pytest.approx(beta, rel=0.05)
    assert len(res) == len(samples)
    for (kind, p, n, t), r in zip(samples, res):
        assert abs(r) / t < 0.15
    # exact timings: exact fit, zero residuals
    exact = [(k, p, n, sf.cost.collective_time(k, n, p, link)) for k, p, n, _ in samples]
    a, b, res = fit_alpha_beta(exact)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    assert max(abs(r) for r in res) < 1e-12


def test_fit_errors_and_nonnegativity():
    with pytest.raises(CostError, match="at least 2"):
        fit_alpha_beta([("all_gather", 2, 100, 1e-3)])
    with pytest.raises(CostError, match="apart"):
        fit_alpha_beta([("all_gather", 2, 100, 1e-3), ("all_gather", 2, 100, 2e-3)])
    with pytest.raises(CostError, match="kind"):
        fit_alpha_beta([("broadcast", 2, 100, 1e-3), ("broadcast", 2, 200, 1e-3)])
    # time that falls with size would need beta < 0: clamped to a latency-only fit
    a, b, _ = fit_alpha_beta([("p2p", 2, 100, 2e-3), ("p2p", 2, 10**6, 1e-3)])
    assert b == 0.0 and a > 0


# -- real calibration ------------------------------------------------------------------------------
def _check_calibration(cluster, report, world, dpn, n_samples):
    assert isinstance(cluster, Cluster)
    assert cluster.world_size == world and cluster.devices_per_node == dpn
    assert len(report.samples) == n_samples
    for link in report.fits:
        a, b = report.fits[link]
        assert a >= 0 and b >= 0 and a + b > 0
        assert math.isfinite(report.rms[link])
    assert all(s.seconds > 0 and s.predicted >= 0 for s in report.samples)
    assert "alpha" in str(report)


def test_calibrate_threads_two_links(tmp_path):
    """4 threads ranks as 2 nodes x 2 devices: intra and inter fitted separately."""
    kwargs = dict(sizes=(4096, 256 << 10), repeats=2, inner=2, devices_per_node=2)
    out = sf.launch(_calibrate_rank, 4, args=(kwargs,))
    cluster, report = out[0]
    assert all(c == cluster for c, _ in out)  # every rank agrees
    _check_calibration(cluster, report, 4, 2, n_samples=2 * 5 * 2)  # links x kinds x sizes
    assert set(report.fits) == {"intra", "inter"} and not report.copied
    assert cluster.intra == Link(*report.fits["intra"])
    assert cluster.inter == Link(*report.fits["inter"])
    assert {s.p for s in report.samples} == {2}
    with pytest.raises(CostError, match="at least 2 ranks"):
        sf.cost.calibrate()  # a single-rank world
    with pytest.raises(CostError, match="divisor"):
        sf.launch(sf.cost.calibrate, 4, kwargs=dict(devices_per_node=3))


def test_calibrate_command_threads(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    assert calibrate_main(["-n", "4", "--sizes", "4096,65536", "--repeats", "1", "--inner", "1",
                           "--out", str(path)]) == 0
    text = capsys.readouterr().out
    assert "intra: alpha" in text and "copied from intra" in text
    c = Cluster.load(path)
    assert (c.nodes, c.devices_per_node) == (1, 4) and c.inter == c.intra
    assert json.loads(path.read_text())["calibration"]["world_size"] == 4


@pytest.mark.gloo
def test_calibrate_gloo(tmp_path, capsys):
    """4 gloo processes through `sbpflow calibrate --backend torch`."""
    path = tmp_path / "cluster.json"
    args = argparse.Namespace(nproc=4, backend="torch", out=str(path), sizes=[4096, 262144],
                              group_sizes=None, repeats=2, inner=2, devices_per_node=None)
    assert calibrate_command(args) == 0
    assert "calibration on 4 torch rank(s)" in capsys.readouterr().out
    c = Cluster.load(path)
    report = json.loads(path.read_text())["calibration"]
    assert report["backend"] == "torch" and c.world_size == 4
    # group sizes 2 and 4, 5 kinds (p2p included), 2 sizes
    assert len(report["samples"]) == 2 * 5 * 2
    assert c.intra.alpha >= 0 and c.intra.beta >= 0 and c.intra.alpha + c.intra.beta > 0


def test_a_linear_time_is_the_collective_time_of_its_group_for_any_size():
    """`linear_time` (found once per group, as the search prices) gives `CollectiveFit.time`'s
    floats for every kind, variant, group size and size, past a fit's knee too."""
    from sbpflow.comm.kinds import LINEAR_KINDS, VARIANTS
    from sbpflow.cost.formulas import (CollectiveFit, collective_time, latency_messages,
                                       linear_time, volume)
    fits = [CollectiveFit(3e-6, 1.7e-10, 9e-6), CollectiveFit(2e-6, 1e-10, 4e-6, "", 3e-11, 1e5)]
    fits += [CollectiveFit(3e-6, 1.7e-10, 9e-6, alg) for _, alg in VARIANTS]
    checked = 0
    for kind in sorted(LINEAR_KINDS):
        for fit in fits:
            if fit.algorithm and (kind, fit.algorithm) not in VARIANTS:
                continue
            for p in (1, 2, 3, 8, 24):
                lt = linear_time(kind, p, fit)
                for n in (0.0, 1.0, 4096.0, 3e5 / 7, 1e9 + 0.5):
                    want = 0.0 if p == 1 else fit.time(latency_messages(kind, p, fit.algorithm),
                                                       volume(kind, n, p, fit.algorithm))
                    assert lt.time(n) == want == collective_time(kind, n, p, fit), \
                        (kind, fit, p, n)
                    checked += 1
    assert checked == 275   # 5 kinds x 2 fits + the direct all-reduce, x 5 groups x 5 sizes
