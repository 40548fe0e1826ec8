"""Reshapes of nested splits (several mesh dims splitting one axis, issue 18): against an
independent oracle (explicit index sets), a reshape / flatten moves no byte exactly when some
output layout keeps every rank's elements, and then gives such a layout; values and gradients
equal torch for every layout of many shapes on 1-D, 2x2, 2x3 and 2x2x2 meshes."""

import itertools
import math

import pytest
import torch

import sbpflow as sf
from sbpflow.ops.shape import flat_runs, same_shards
from sbpflow.sbp import Split, shard_box

# (input shape, output shape): splits, merges, regroupings, uneven ones, size-1 axes
PAIRS = [
    ((8, 4), (2, 4, 4)), ((2, 4, 4), (8, 4)), ((8, 4), (32,)), ((16,), (2, 2, 4)),
    ((2, 2, 4), (16,)), ((4, 6), (24,)), ((4, 6), (2, 12)), ((12, 5), (2, 6, 5)),
    ((12, 5), (3, 4, 5)), ((6, 4), (2, 3, 4)), ((6,), (2, 3)), ((6, 2), (3, 4)),
    ((10, 3), (2, 5, 3)), ((2, 3, 4), (6, 4)), ((2, 3, 4), (24,)), ((3, 8), (3, 2, 4)),
    ((3, 8), (3, 4, 2)), ((4, 4, 3), (16, 3)), ((24,), (2, 3, 4)), ((24,), (4, 6)),
    ((8, 6), (2, 4, 2, 3)), ((2, 8), (16,)), ((16, 2), (2, 2, 2, 2, 2)), ((5, 7), (35,)),
    ((9, 2), (3, 3, 2)), ((4, 1, 6), (2, 2, 6)), ((7, 4), (28,)),
]
MESHES = {"1d": [0, 1, 2, 3], "2x2": [[0, 1], [2, 3]], "2x3": [[0, 1, 2], [3, 4, 5]],
          "2x2x2": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]}


def _flat_set(shape, box) -> torch.Tensor:
    """The row-major flat indices ``box`` covers, in increasing order (the oracle)."""
    idx = torch.arange(math.prod(shape)).reshape(shape)
    return idx[tuple(slice(s, s + n) for s, n in box)].reshape(-1)


def _free_outputs(xs, ys, mesh_shape, nd) -> list:
    """Every output nd-sbp (each split dim mapped to some split of ``ys``, the rest kept) under
    which every rank's input and output shards hold the same elements: the free reshapes."""
    choices = [[sf.S(b) for b in range(len(ys))] if isinstance(s, Split) else [s] for s in nd]
    free = []
    for out in itertools.product(*choices):
        if all(torch.equal(_flat_set(xs, shard_box(xs, mesh_shape, nd, c)),
                           _flat_set(ys, shard_box(ys, mesh_shape, out, c)))
               for c in itertools.product(*(range(m) for m in mesh_shape))):
            free.append(out)
    return free


def _layouts(ndim: int, mesh_ndim: int, broadcast: bool = True) -> list:
    """Every nd-sbp of splits (and B) with at least one split, plus one with a partial dim."""
    one = [sf.S(a) for a in range(ndim)] + [sf.B] * broadcast
    out = [nd for nd in itertools.product(one, repeat=mesh_ndim)
           if any(isinstance(s, Split) for s in nd)]
    return out + [(sf.P,) + (sf.S(0),) * (mesh_ndim - 1)]


# -- the canonical form of a box's elements --------------------------------------------------------
def test_flat_runs_is_canonical():
    """Two boxes (of any shapes with the same element count) have equal `flat_runs` iff they
    cover the same flat indices: checked on every box of every shape of 12 and 16 elements."""
    for numel in (12, 16):
        shapes = [s for k in range(1, 5) for s in itertools.product(range(1, numel + 1), repeat=k)
                  if math.prod(s) == numel]
        forms = {}
        for shape in shapes:
            spans = [[(s, n) for s in range(d) for n in range(1, d - s + 1)] for d in shape]
            for box in itertools.product(*spans):
                key = tuple(_flat_set(shape, box).tolist())
                forms.setdefault(flat_runs(shape, box), set()).add(key)
        by_set = {}
        for form, sets in forms.items():
            assert len(sets) == 1, (form, sets)
            by_set.setdefault(next(iter(sets)), set()).add(form)
        assert all(len(f) == 1 for f in by_set.values()), \
            [f for f in by_set.values() if len(f) > 1][:3]
    assert flat_runs((3, 4), ((0, 0), (0, 4))) is None


def test_same_shards_matches_the_oracle():
    for xs, ys in PAIRS:
        for mesh_shape in ((2, 2), (2, 3), (4,)):
            for nd in _layouts(len(xs), len(mesh_shape))[:-1]:
                for out in itertools.product(*([sf.S(b) for b in range(len(ys))] if
                                               isinstance(s, Split) else [s] for s in nd)):
                    want = out in _free_outputs(xs, ys, mesh_shape, nd)
                    assert same_shards(xs, ys, mesh_shape, nd, out) == want, (xs, ys, nd, out)


# -- end to end: values, gradients, bytes ----------------------------------------------------------
def _run_cases(ranks, cases):
    """Inside each rank: reshape (or flatten) every case's global tensor, then backward.
    Returns per case (output sbp, bytes sent forward, bytes sent backward, value ok, grad ok)."""
    mesh = sf.placement("cpu", ranks)
    results = []
    for kind, xs, ys, nd, arg, full, w in cases:
        x = sf.tensor(full, mesh, nd).requires_grad_()
        sf.comm.reset_stats()
        y = x.reshape(*ys) if kind == "reshape" else x.flatten(*arg)
        fwd = sf.comm.stats().sent
        value_ok = torch.equal(y.full_tensor(), full.reshape(ys))
        sf.comm.reset_stats()
        y.backward(sf.tensor(w, mesh, (sf.B,) * mesh.ndim))
        bwd = sf.comm.stats().sent
        grad_ok = torch.equal(x.grad.full_tensor(), w.reshape(xs))
        results.append((y.sbp, fwd, bwd, value_ok, grad_ok))
    return results


def _cases(mesh_ndim: int, pairs, flatten: bool = False, broadcast: bool = True) -> list:
    cases = []
    for i, (xs, ys) in enumerate(pairs):
        g = torch.Generator().manual_seed(i)
        full = torch.randn(xs, generator=g, dtype=torch.float64)
        w = torch.randn(ys, generator=g, dtype=torch.float64)
        kind = "flatten" if flatten else "reshape"
        arg = _flatten_args(xs, ys) if flatten else None
        for nd in _layouts(len(xs), mesh_ndim, broadcast):
            cases.append((kind, xs, ys, nd, arg, full, w))
    return cases


def _flatten_args(xs, ys):
    """(start, end) with ``xs.flatten(start, end).shape == ys``."""
    for s in range(len(xs)):
        for e in range(s, len(xs)):
            if xs[:s] + (math.prod(xs[s:e + 1]),) + xs[e + 1:] == ys:
                return s, e
    raise AssertionError((xs, ys))


def _check(mesh_name: str, cases):
    ranks = MESHES[mesh_name]
    mesh_shape = tuple(torch.tensor(ranks).shape)
    per_rank = sf.launch(_run_cases, world_size=math.prod(mesh_shape), args=(ranks, cases))
    bad, free_seen = [], 0
    for k, (kind, xs, ys, nd, _, _, _) in enumerate(cases):
        sbp, _, _, value_ok, grad_ok = per_rank[0][k]
        moved = max(r[k][1] + r[k][2] for r in per_rank)
        # a split of a size-1 axis (every rank but one empty) is not followed: boxed instead
        degenerate = any(isinstance(s, Split) and xs[s.axis] == 1 for s in nd)
        free = [] if degenerate else _free_outputs(xs, ys, mesh_shape, nd)
        if not (value_ok and grad_ok):
            bad.append(("value/grad", kind, xs, ys, nd, sbp))
        if free:
            free_seen += 1
            if moved or sbp not in free:
                bad.append(("not free", kind, xs, ys, nd, sbp, moved, free))
    assert not bad, bad[:40]
    return free_seen


@pytest.mark.parametrize("mesh_name", ["1d", "2x2", "2x3"])
def test_reshape_free_exactly_when_the_shards_stay(mesh_name):
    mesh_ndim = 1 if mesh_name == "1d" else 2
    assert _check(mesh_name, _cases(mesh_ndim, PAIRS)) > 0


@pytest.mark.slow
def test_reshape_on_a_3d_mesh():
    """Splits only (three nested splits of one axis among them); a cold dispatch on a 3-D mesh
    prices many candidates, so the cases are few."""
    pairs = [((8, 4), (2, 4, 4)), ((16,), (2, 2, 4)), ((24,), (2, 3, 4)),
             ((8, 6), (2, 4, 2, 3)), ((16, 2), (2, 2, 2, 2, 2)), ((6,), (2, 3))]
    cases = _cases(3, pairs, broadcast=False)
    S = sf.S
    cases += [c for c in _cases(3, [((2, 4, 4), (8, 4))], broadcast=False)
              if c[3] in {(S(0), S(1), S(1)), (S(0), S(0), S(1)), (S(1), S(1), S(0)),
                          (S(0), S(1), S(2))}]
    assert _check("2x2x2", cases) > 0


@pytest.mark.parametrize("mesh_name", ["2x2", "2x3"])
def test_flatten_follows_nested_splits(mesh_name):
    pairs = [(xs, ys) for xs, ys in PAIRS if len(ys) < len(xs)]
    pairs = [(xs, ys) for xs, ys in pairs if _flatten_or_none(xs, ys)]
    assert _check(mesh_name, _cases(2, pairs, flatten=True)) > 0


def _flatten_or_none(xs, ys):
    try:
        return _flatten_args(xs, ys)
    except AssertionError:
        return None


def test_issue_example():
    """(8, 4) laid out (S(0), S(0)) on 2x2 viewed as (2, 4, 4): (S(0), S(1)), no collective
    (OneFlow's answer); and back again."""
    def body():
        mesh = sf.placement("cpu", [[0, 1], [2, 3]])
        full = torch.arange(32.0, dtype=torch.float64).reshape(8, 4)
        x = sf.tensor(full, mesh, (sf.S(0), sf.S(0)))
        sf.comm.reset_stats()
        y = x.view(2, 4, 4)
        z = y.view(8, 4)
        f = y.flatten(0, 1)
        stats = sf.comm.stats()
        ok = torch.equal(y.full_tensor(), full.view(2, 4, 4)) and \
            torch.equal(z.full_tensor(), full) and torch.equal(f.full_tensor(), full)
        return y.sbp, z.sbp, f.sbp, stats.sent, stats.recv, sum(
            v.calls for v in stats.kinds.values()), ok
    for y_sbp, z_sbp, f_sbp, sent, recv, calls, ok in sf.launch(body, world_size=4):
        assert ok
        assert (sent, recv, calls) == (0, 0, 0)
        assert y_sbp == (sf.S(0), sf.S(1))
        assert z_sbp == f_sbp == (sf.S(0), sf.S(0))
