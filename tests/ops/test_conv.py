"""CNN ops (conv2d, max/avg/adaptive-avg pooling): every signature on a 1-D mesh of 3 ranks and
the 2x2 mesh equals torch, forward and gradients of input, weight and bias; uneven sizes
(N=5, 3 or 6 channels, 7x7 images), empty shards, stride / padding / dilation / groups variants."""

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf
from sbpflow.nn import functional_conv as FC
from sbpflow.sbp import Partial
from sbptest import check_op_signatures

MESHES = [[0, 1, 2], [[0, 1], [2, 3]]]


def _t(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


_run = check_op_signatures


# -- conv2d -------------------------------------------------------------------------------------
CONV_CASES = {
    # name: (x shape, weight shape, bias?, stride, padding, dilation, groups)
    "plain": ((5, 3, 7, 7), (4, 3, 3, 3), True, 1, 0, 1, 1),
    # 3 output channels: an empty output-channel shard on the 2x2 mesh
    "stride_pad_rect": ((5, 3, 7, 7), (3, 3, 3, 2), True, 2, (1, 0), 1, 1),
    "same_dilated": ((5, 6, 7, 7), (4, 6, 3, 3), False, 1, "same", 2, 1),
    "grouped": ((5, 6, 7, 7), (6, 2, 3, 3), True, 2, 1, 1, 3),
    "depthwise": ((5, 6, 7, 7), (6, 1, 3, 3), True, 1, 1, 1, 6),
    "depthwise_x2": ((5, 3, 7, 7), (6, 1, 3, 3), False, 1, 1, 1, 3),  # O != C: no group split
    "unbatched": ((3, 7, 7), (4, 3, 3, 3), True, 1, 1, 1, 1),
}


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv2d(ranks, case):
    xs, ws, bias, stride, padding, dilation, groups = CONV_CASES[case]
    args = (_t(*xs), _t(*ws, seed=1), _t(ws[0], seed=2) if bias else None,
            stride, padding, dilation, groups)
    layouts = _run("conv2d", FC.conv2d, F.conv2d, args, ranks)
    x_layouts = {lay[0] for lay in layouts}
    c = len(xs) - 3
    pairs = {(sx, sw) for nx, nw, *_ in layouts for sx, sw in zip(nx, nw)}
    assert ((sf.S(c), sf.S(1)) in pairs) == (groups == 1)  # input-channel split
    assert ((sf.B, sf.S(0)) in pairs) == (groups == 1)  # output-channel split
    assert ((sf.S(c), sf.S(0)) in pairs) == (groups > 1 and ws[0] == xs[c])  # group split
    assert not any(sf.S(a) in nd for nd in x_layouts for a in (c + 1, c + 2))  # no spatial split


@pytest.mark.parametrize("ranks", MESHES)
def test_spatially_split_inputs_are_boxed(ranks):
    """H / W splits are not signatures; such inputs are redistributed first and still exact,
    gradients included (max pooling must not fall back to a gradient-less P(max) layout)."""
    pl = sf.placement("cpu", ranks)
    x, w, b = _t(5, 3, 7, 7), _t(4, 3, 3, 3, seed=1), _t(4, seed=2)
    spatial = [tuple(sf.S(a) for _ in range(pl.ndim)) for a in (2, 3)]
    _run("conv2d", FC.conv2d, F.conv2d, (x, w, b, 1, 1, 1, 1), ranks,
         layouts=[(s, (sf.B,) * pl.ndim, (sf.B,) * pl.ndim) for s in spatial])
    _run("max_pool2d", FC.max_pool2d, F.max_pool2d, (x, 3, 2, 1), ranks,
         layouts=[(s,) for s in spatial])


# -- pooling ------------------------------------------------------------------------------------
POOL_CASES = {
    "max": ("max_pool2d", FC.max_pool2d, F.max_pool2d, (5, 3, 7, 7), (3, 2, 1)),
    "max_dilated_ceil_indices": ("max_pool2d", FC.max_pool2d, F.max_pool2d, (5, 6, 7, 7),
                                 ((3, 2), None, (1, 0), 2, True, True)),
    "max_unbatched": ("max_pool2d", FC.max_pool2d, F.max_pool2d, (3, 7, 7), (2,)),
    "avg": ("avg_pool2d", FC.avg_pool2d, F.avg_pool2d, (5, 3, 7, 7), (3, 2, 1, True, False)),
    "avg_divisor": ("avg_pool2d", FC.avg_pool2d, F.avg_pool2d, (5, 3, 7, 7),
                    (2, None, 0, False, True, 3)),
    "adaptive": ("adaptive_avg_pool2d", FC.adaptive_avg_pool2d, F.adaptive_avg_pool2d,
                 (5, 3, 7, 7), ((3, 2),)),
    "adaptive_none_unbatched": ("adaptive_avg_pool2d", FC.adaptive_avg_pool2d,
                                F.adaptive_avg_pool2d, (6, 7, 7), ((4, None),)),
}


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_pooling(ranks, case):
    name, fn, ref, xs, consts = POOL_CASES[case]
    layouts = _run(name, fn, ref, (_t(*xs),) + consts, ranks)
    assert any(sf.P in lay[0] for lay in layouts) == (name != "max_pool2d")  # linear ones only
    assert not any(isinstance(s, Partial) and s.op != "sum" for lay in layouts for s in lay[0])


def test_pool_layouts_follow_the_input():
    """Batch / channel splits and partial sums pass through pooling without communication."""
    def body():
        mesh = sf.placement("cpu", [[0, 1], [2, 3]])
        x = sf.randn(5, 3, 7, 7, placement=mesh, sbp=(sf.S(0), sf.S(1)), seed=0)
        p = sf.randn(5, 3, 7, 7, placement=mesh, sbp=(sf.P, sf.B), seed=0)
        sf.comm.reset_stats()
        out = [FC.max_pool2d(x, 2).sbp, FC.avg_pool2d(p, 3).sbp,
               FC.adaptive_avg_pool2d(p, 1).sbp]
        return out, sf.comm.stats().sent
    sbps, sent = sf.launch(body, world_size=4)[0]
    # the partial sum passes through; a replicated dim may be sliced for free (a split output
    # is cheaper to reduce later)
    assert sbps[0] == (sf.S(0), sf.S(1)) and sbps[1][0] == sf.P and sbps[2][0] == sf.P
    assert sent == 0


# -- choices and a small CNN ----------------------------------------------------------------------
def test_group_split_only_on_whole_groups():
    """C=6 in 3 groups of 2: 3 ranks hold one group each (local, no communication); the 2x2 mesh
    would cut a group (shards of 3 channels), so the group split is rejected there."""
    def body(ranks, sbp_x, sbp_w):
        pl = sf.placement("cpu", ranks)
        x = sf.randn(5, 6, 7, 7, placement=pl, sbp=sbp_x, seed=0)
        w = sf.randn(6, 2, 3, 3, placement=pl, sbp=sbp_w, seed=1)
        sf.comm.reset_stats()
        y = FC.conv2d(x, w, None, 1, 1, 1, 3)
        sent = sf.comm.stats().sent
        ref = F.conv2d(x.full_tensor(), w.full_tensor(), None, 1, 1, 1, 3)
        return y.sbp, sent, float((y.full_tensor() - ref).abs().max())
    sbp, sent, err = sf.launch(body, world_size=3, args=([0, 1, 2], sf.S(1), sf.S(0)))[0]
    assert sbp == (sf.S(1),) and sent == 0 and err < 1e-5
    sbp, sent, err = sf.launch(body, world_size=4,
                               args=([[0, 1], [2, 3]], (sf.B, sf.S(1)), (sf.B, sf.S(0))))[0]
    assert sbp[1] != sf.S(1) and err < 1e-5


def test_channel_parallel_cnn_needs_no_communication_until_the_end():
    """Data parallel on mesh dim 0; on dim 1 conv1 splits output channels, conv2 input channels
    (partial sums), average pooling keeps them partial: like Megatron's MLP, no bytes move until
    the result is read. Gradients of every parameter equal torch's."""
    xs, w1s, b1s, w2s, b2s = (5, 3, 7, 7), (6, 3, 3, 3), (6,), (4, 6, 3, 3), (4,)
    full = [_t(*s, seed=i) for i, s in enumerate((xs, w1s, b1s, w2s, b2s))]

    def net(x, w1, b1, w2, b2, F_, relu):
        h = relu(F_.conv2d(x, w1, b1, 1, 1))
        h = F_.conv2d(h, w2, b2, 2, 1)
        h = F_.avg_pool2d(h, 2, 1)
        return F_.adaptive_avg_pool2d(h, 1)

    ref_in = [t.clone().requires_grad_() for t in full]
    ref = net(*ref_in, F, torch.relu)
    seed = _t(*ref.shape, seed=9)
    (ref * seed).sum().backward()

    def body():
        mesh = sf.placement("cpu", [[0, 1], [2, 3]])
        layouts = [(sf.S(0), sf.B), (sf.B, sf.S(0)), (sf.B, sf.S(0)), (sf.B, sf.S(1)), (sf.B, sf.B)]
        ts = [sf.tensor(t, mesh, nd).requires_grad_() for t, nd in zip(full, layouts)]
        sf.comm.reset_stats()
        y = net(*ts, FC, lambda t: sf.apply_op("relu", t))
        sent = sf.comm.stats().sent
        y.backward(sf.tensor(seed, mesh, (sf.B, sf.B)))
        return (y.sbp, sent, y.full_tensor(), [t.grad.full_tensor() for t in ts],
                [t.grad.sbp for t in ts])
    sbp, sent, out, grads, grad_sbps = sf.launch(body, world_size=4)[0]
    assert sbp == (sf.S(0), sf.P) and sent == 0
    assert torch.allclose(out, ref, atol=1e-9)
    for g, r in zip(grads, ref_in):
        assert torch.allclose(g, r.grad, atol=1e-9)
    assert grad_sbps[0] == (sf.S(0), sf.P) and grad_sbps[1] == (sf.P, sf.S(0))


def test_bad_shapes_raise_shape_errors_naming_the_shapes():
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.randn(5, 3, 7, 7, placement=pl, sbp=sf.S(0), seed=0)
        msgs = []
        for fn in (lambda: FC.conv2d(x, sf.randn(4, 2, 3, 3, placement=pl, seed=1)),
                   # a logically wrong groups that a channel shard could be mistaken for
                   lambda: FC.conv2d(sf.randn(5, 6, 7, 7, placement=pl, seed=0),
                                     sf.randn(6, 3, 3, 3, placement=pl, seed=1), None, 1, 0, 1, 3),
                   lambda: FC.conv2d(x, sf.randn(4, 3, 9, 9, placement=pl, seed=1)),
                   lambda: FC.max_pool2d(x, 9),
                   lambda: FC.avg_pool2d(sf.randn(5, 7, placement=pl, seed=0), 2)):
            try:
                fn()
            except sf.SbpError as e:
                msgs.append((type(e).__name__, str(e)))
            else:
                msgs.append(None)
        return msgs
    msgs = sf.launch(body, world_size=2)[0]
    assert all(m is not None and m[0] == "ShapeError" for m in msgs), msgs
    (_, m1), (_, m2), (_, m3), (_, m4), (_, m5) = msgs
    assert "(5, 3, 7, 7)" in m1 and "(4, 2, 3, 3)" in m1 and "conv2d" in m1
    assert "(5, 6, 7, 7)" in m2 and "(6, 3, 3, 3)" in m2 and "groups=3" in m2
    assert "(4, 3, 9, 9)" in m3
    assert "max_pool2d" in m4 and "(5, 3, 7, 7)" in m4
    assert "(5, 7)" in m5
