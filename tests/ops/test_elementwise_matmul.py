"""Elementwise and matmul/linear ops: every signature on 1-D and 2x2 meshes equals torch,
forward and gradients, uneven sizes included."""

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf
from sbpflow.tensor import apply_op
from sbptest import check_op_signatures

MESHES = [[0, 1, 2], [[0, 1], [2, 3]]]


_run = check_op_signatures


def _t(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("name,ref", [("add", torch.add), ("sub", torch.sub), ("mul", torch.mul),
                                      ("div", torch.div), ("maximum", torch.maximum)])
def test_binary_with_broadcasting(ranks, name, ref):
    a, b = _t(5, 7), _t(7, seed=1).abs() + 0.5
    _run(name, lambda x, y: apply_op(name, x, y), ref, (a, b), ranks)
    _run(name, lambda x, y: apply_op(name, x, y), ref, (_t(5, 1, 3), _t(4, 3, seed=2) + 3), ranks)


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("name,ref", [("exp", torch.exp), ("tanh", torch.tanh), ("relu", torch.relu),
                                      ("gelu", F.gelu), ("neg", torch.neg), ("sigmoid", torch.sigmoid)])
def test_unary(ranks, name, ref):
    _run(name, lambda x: apply_op(name, x), ref, (_t(5, 7),), ranks)


@pytest.mark.parametrize("ranks", MESHES)
def test_scalar_operands_keep_partial_only_when_linear(ranks):
    x = _t(5, 7)
    _run("mul", lambda t, c: apply_op("mul", t, c), torch.mul, (x, 3.0), ranks)
    layouts = _run("add", lambda t, c: apply_op("add", t, c), torch.add, (x, 3.0), ranks)
    assert all(sf.P not in nd for lay in layouts for nd in lay)


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("sa,sb", [((5, 6), (6, 7)), ((2, 5, 6), (6, 7)), ((2, 5, 6), (2, 6, 3)),
                                   ((6,), (6, 7)), ((3, 1, 4, 6), (2, 6, 5))])
def test_matmul(ranks, sa, sb):
    _run("matmul", lambda x, y: apply_op("matmul", x, y), torch.matmul,
         (_t(*sa), _t(*sb, seed=1)), ranks)


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear(ranks, bias):
    x, w, b = _t(2, 5, 6), _t(7, 6, seed=1), _t(7, seed=2)
    args = (x, w, b) if bias else (x, w)
    _run("linear", lambda *t: apply_op("linear", *t), F.linear, args, ranks)


def test_signature_choice_follows_megatron():
    """Column then row parallel: no communication until the partial sum must be reduced."""
    def body():
        mesh = sf.placement("cpu", [[0, 1], [2, 3]])
        x = sf.randn(4, 6, placement=mesh, sbp=(sf.S(0), sf.B), seed=0)
        w1 = sf.randn(8, 6, placement=mesh, sbp=(sf.B, sf.S(0)), seed=1)
        w2 = sf.randn(6, 8, placement=mesh, sbp=(sf.B, sf.S(1)), seed=2)
        sf.comm.reset_stats()
        h = apply_op("linear", x, w1)
        y = apply_op("linear", h, w2)
        return h.sbp, y.sbp, sf.comm.stats().sent
    h, y, sent = sf.launch(body, world_size=4)[0]
    assert h == (sf.S(0), sf.S(1)) and y == (sf.S(0), sf.P) and sent == 0


def test_mismatched_placements_and_forced_signatures():
    def body():
        a = sf.randn(4, 4, placement=sf.placement("cpu", [0, 1]), sbp=sf.B, seed=0)
        b = sf.randn(4, 4, placement=sf.placement("cpu", [2, 3]), sbp=sf.B, seed=0)
        try:
            apply_op("add", a, b)
        except sf.errors.PlacementMismatchError as e:
            msg1 = str(e)
        c = sf.randn(4, 4, placement=sf.placement("cpu", [0, 1]), sbp=sf.B, seed=0)
        try:
            apply_op("exp", c, sbp=[(sf.P,)])
        except sf.errors.SignatureError as e:
            msg2 = str(e)
        y = apply_op("mul", c, c, sbp=[(sf.S(1),), None])
        try:
            apply_op("matmul", sf.randn(4, 5, seed=0), sf.randn(4, 5, seed=1))
        except sf.ShapeError as e:
            msg3 = str(e)
        return msg1, msg2, y.sbp, msg3
    m1, m2, sbp, m3 = sf.launch(body, world_size=4)[0]
    assert "cpu[0,1]" in m1 and "cpu[2,3]" in m1 and "to_global" in m1
    assert "exp" in m2 and "P" in m2 and "(4, 4)" in m2
    assert sbp == (sf.S(1),)
    assert "(4, 5)" in m3
