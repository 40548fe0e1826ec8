"""GlobalTensor: creation ops, from_local / tensor, metadata, repr and errors."""

import pytest
import torch

import sbpflow as sf
from sbptest import nd_sbps

MESH = [[0, 1], [2, 3]]


@pytest.mark.parametrize("maker", ["randn", "rand"])
def test_same_seed_same_tensor_in_every_layout(maker):
    def body():
        fn = getattr(sf, maker)
        ref = fn(7, 70000 // 7 + 3, placement=sf.placement("cpu", [0]), sbp=sf.B, seed=11).full_tensor()
        outs = []
        for ranks in ([0, 1, 2, 3], MESH, [1, 3]):
            pl = sf.placement("cpu", ranks)
            for nd in nd_sbps(2, pl.ndim):
                x = fn(ref.shape, placement=pl, sbp=nd, seed=11)
                outs.append(torch.equal(x.full_tensor(), ref))
        return all(outs), ref.std().item()
    for ok, std in sf.launch(body, world_size=4):
        assert ok
    # and it is a real random tensor
    assert 0.2 < std < 1.2


def test_creation_materialises_only_the_shard_plus_a_block(monkeypatch):
    from sbpflow import random_regions
    drawn = []
    real = random_regions._draw
    monkeypatch.setattr(random_regions, "_draw", lambda kind, n, g, dt: drawn.append(n) or real(kind, n, g, dt))

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        x = sf.randn(1024, 1024, placement=pl, sbp=sf.S(0), seed=1)
        return x.local.numel()
    sf.launch(body, world_size=4)
    # 16 blocks of 65536 in the tensor; each rank draws only the 4 its quarter spans
    assert len(drawn) == 16 and sum(drawn) == 1024 * 1024


def test_default_seed_stream_agrees_across_ranks():
    def body():
        sf.manual_seed(5)
        pl = sf.placement("cpu", [0, 1])
        a = sf.randn(6, placement=pl, sbp=sf.S(0))
        b = sf.randn(6, placement=pl, sbp=sf.B)
        return a.full_tensor(), b.full_tensor()
    (a0, b0), (a1, b1) = sf.launch(body, world_size=2)
    assert torch.equal(a0, a1) and torch.equal(b0, b1) and not torch.equal(a0, b0)


def test_generator_seeding():
    def body():
        g = torch.Generator().manual_seed(3)
        return sf.randn(4, placement=sf.placement("cpu", [0, 1]), sbp=sf.S(0), generator=g).full_tensor()
    a, b = sf.launch(body, world_size=2)
    assert torch.equal(a, b)


def test_zeros_ones_full_arange():
    def body():
        pl = sf.placement("cpu", MESH)
        out = {}
        out["z"] = sf.zeros(3, 5, placement=pl, sbp=(sf.S(0), sf.P)).full_tensor()
        out["o"] = sf.ones((3, 5), placement=pl, sbp=(sf.P, sf.P)).full_tensor()
        out["f"] = sf.full((2, 3), 7, placement=pl, sbp=(sf.B, sf.S(1))).full_tensor()
        out["a"] = sf.arange(11, placement=pl, sbp=(sf.S(0), sf.S(0))).full_tensor()
        out["af"] = sf.arange(0.5, 3.0, 0.25, placement=pl, sbp=(sf.S(0), sf.B)).full_tensor()
        return out
    for out in sf.launch(body, world_size=4):
        assert torch.equal(out["z"], torch.zeros(3, 5)) and torch.equal(out["o"], torch.ones(3, 5))
        assert torch.equal(out["f"], torch.full((2, 3), 7)) and out["f"].dtype == torch.int64
        assert torch.equal(out["a"], torch.arange(11))
        assert torch.equal(out["af"], torch.arange(0.5, 3.0, 0.25))


def test_tensor_and_from_local():
    full = torch.arange(35.0).reshape(5, 7)

    def body():
        pl = sf.placement("cpu", MESH)
        x = sf.tensor(full, pl, (sf.S(0), sf.S(1)))
        y = sf.from_local(x.local.clone(), pl, (sf.S(0), sf.S(1)))  # shape inferred
        z = sf.from_local(x.local.clone(), pl, (sf.S(0), sf.S(1)), shape=(5, 7))
        return y.shape, z.full_tensor(), x.local.shape
    res = sf.launch(body, world_size=4)
    assert all(r[0] == (5, 7) and torch.equal(r[1], full) for r in res)
    assert [tuple(r[2]) for r in res] == [(3, 4), (3, 3), (2, 4), (2, 3)]


def test_from_local_nested_split_inference():
    def body():
        pl = sf.placement("cpu", MESH)
        x = sf.arange(6, placement=pl, sbp=(sf.S(0), sf.S(0)))
        y = sf.from_local(x.local.clone(), pl, (sf.S(0), sf.S(0)))
        return y.shape, torch.equal(y.full_tensor(), torch.arange(6))
    assert sf.launch(body, world_size=4) == [((6,), True)] * 4


def test_from_local_shards_that_disagree():
    def body():
        pl = sf.placement("cpu", [0, 1, 2])
        local = torch.zeros(2 if sf.rank() != 1 else 5, 3)
        return sf.from_local(local, pl, sf.S(0))
    with pytest.raises(sf.ShapeError, match="do not fit"):
        sf.launch(body, world_size=3)

    def body2():
        pl = sf.placement("cpu", [0, 1])
        return sf.from_local(torch.zeros(3, 3 + sf.rank()), pl, sf.S(0))  # non-split axis differs
    with pytest.raises(sf.ShapeError):
        sf.launch(body2, world_size=2)

    def body3():
        pl = sf.placement("cpu", [0, 1])
        return sf.from_local(torch.zeros(3, 4), pl, sf.S(0), shape=(5, 4))
    with pytest.raises(sf.ShapeError, match=r"\(5, 4\)"):
        sf.launch(body3, world_size=2)


def test_metadata_and_repr():
    def body():
        pl = sf.placement("cpu", MESH)
        x = sf.zeros(6, 10, placement=pl, sbp=(sf.S(0), sf.S(1)))
        return x.shape, x.dtype, x.placement, x.sbp, x.local.shape, repr(x), x.ndim, x.numel()
    shape, dtype, pl, sbp, lshape, text, ndim, numel = sf.launch(body, world_size=4)[3]
    assert shape == (6, 10) and dtype == torch.float32 and sbp == (sf.S(0), sf.S(1))
    assert pl == sf.placement("cpu", MESH) and lshape == (3, 5) and ndim == 2 and numel == 60
    assert "S(0), S(1)" in text and "(6, 10)" in text and "cpu[[0,1],[2,3]]" in text


def test_rank_outside_placement_holds_empty_shard():
    def body():
        x = sf.ones(4, placement=sf.placement("cpu", [1]), sbp=sf.B)
        return x.local.numel(), x.full_tensor().tolist()
    assert sf.launch(body, world_size=3) == [(0, [1.0] * 4), (4, [1.0] * 4), (0, [1.0] * 4)]


@pytest.mark.parametrize("case,err,match", [
    ("axis", sf.errors.SplitAxisError, r"split axis 2 is out of range.*\(4, 4\)"),
    ("string", sf.errors.SbpParseError, "unknown sbp"),
    ("length", sf.errors.SbpParseError, "1 entries but the mesh has 2"),
    ("world", sf.PlacementError, "only 2 rank"),
    ("to_global_axis", sf.errors.SplitAxisError, "split axis 5"),
    ("to_global_ndim", sf.SbpError, "give sbp="),
    ("backward_nonscalar", sf.ShapeError, "scalar"),
    # the messages name the tensor's shape, placement and sbp (issue 12's probe,
    # benchmarks/bad_inputs.py)
    ("length_1d", sf.errors.SbpParseError, r"\(S\(0\), B\).*tensor of shape \(4,\) on cpu\[0,1\]"),
    ("to_global_length", sf.errors.SbpParseError, r"tensor of shape \(4,\) on cpu\[0,1\]"),
    ("to_global_ndim_shape", sf.SbpError, r"shape \(4,\) has 1; give sbp="),
    ("backward_no_grad", sf.SbpError, r"shape \(\) on cpu\[0,1\] with sbp \(B,\)"),
    ("backward_gradient", sf.ShapeError, r"gradient: shape \(5,\) on cpu\[0,1\] with sbp \(B,\); "
                                         r"tensor: shape \(4,\) on cpu\[0,1\] with sbp \(B,\)"),
    ("item", sf.ShapeError, r"4 elements.*shape \(4,\) on cpu\[0,1\] with sbp \(B,\)"),
])
def test_bad_input(case, err, match):
    if case in _TORCH_REFUSES:  # the same mistake in plain torch is an error too
        with pytest.raises(RuntimeError):
            _TORCH_REFUSES[case]()

    def body():
        pl = sf.placement("cpu", [[0, 1]])
        line = sf.placement("cpu", [0, 1])
        if case == "axis":
            sf.zeros(4, 4, placement=line, sbp=sf.S(2))
        elif case == "string":
            sf.zeros(4, placement=line, sbp="Q")
        elif case == "length":
            sf.zeros(4, placement=pl, sbp=(sf.S(0),))
        elif case == "world":
            sf.zeros(4, placement=sf.placement("cpu", [0, 1, 2]), sbp=sf.B)
        elif case == "to_global_axis":
            sf.zeros(4, placement=line, sbp=sf.B).to_global(sbp=sf.S(5))
        elif case == "to_global_ndim":
            sf.zeros(4, placement=line, sbp=sf.B).to_global(placement=pl)
        elif case == "backward_nonscalar":
            sf.zeros(4, placement=line, sbp=sf.B, requires_grad=True).backward()
        elif case == "length_1d":
            sf.zeros(4, placement=line, sbp=(sf.S(0), sf.B))
        elif case == "to_global_length":
            sf.zeros(4, placement=line, sbp=sf.B).to_global(sbp="S(0), B")
        elif case == "to_global_ndim_shape":
            sf.zeros(4, placement=line, sbp=sf.B).to_global(placement=pl)
        elif case == "backward_no_grad":
            sf.zeros(4, placement=line, sbp=sf.B).sum().backward()
        elif case == "backward_gradient":
            x = sf.zeros(4, placement=line, sbp=sf.B, requires_grad=True)
            (x * 2.0).backward(sf.ones(5, placement=line, sbp=sf.B))
        elif case == "item":
            sf.zeros(4, placement=line, sbp=sf.B).item()
    with pytest.raises(err, match=match):
        sf.launch(body, world_size=2)


_TORCH_REFUSES = {
    "backward_nonscalar": lambda: torch.zeros(4, requires_grad=True).backward(),
    "backward_no_grad": lambda: torch.zeros(4).sum().backward(),
    "backward_gradient": lambda: (torch.zeros(4, requires_grad=True) * 2.0).backward(
        torch.ones(5)),
    "item": lambda: torch.zeros(4).item(),
}


@pytest.mark.parametrize("make,torch_make,match", [
    (lambda pl: sf.randn(4, 6.5, placement=pl), lambda: torch.randn(4, 6.5), r"\(4, 6\.5\)"),
    (lambda pl: sf.zeros("a", placement=pl), lambda: torch.zeros("a"), r"\('a',\)"),
    (lambda pl: sf.rand((4, 6), 3, placement=pl), lambda: torch.rand((4, 6), 3),
     r"\(\(4, 6\), 3\)"),
    (lambda pl: sf.ones(4, -6, placement=pl), lambda: torch.ones(4, -6), r"\(4, -6\)"),
    (lambda pl: sf.arange(-5, placement=pl), lambda: torch.arange(-5), r"end=-5, step=1"),
    (lambda pl: sf.arange(0, 5, 0, placement=pl), lambda: torch.arange(0, 5, 0), r"step=0"),
    (lambda pl: sf.arange(3, 1, 0.5, placement=pl), lambda: torch.arange(3, 1, 0.5),
     r"start=3, end=1, step=0\.5"),
])
def test_creation_refuses_the_sizes_torch_refuses(make, torch_make, match):
    """A size that is not an int (torch: TypeError; int() would truncate 6.5 silently) or
    negative, and an arange whose step is 0 or points away from end (torch: RuntimeError;
    it used to give an empty tensor) are `sf.ShapeError` naming the values."""
    with pytest.raises((TypeError, RuntimeError)):
        torch_make()
    with pytest.raises(sf.ShapeError, match=match):
        sf.launch(lambda: make(sf.placement("cpu", [0, 1])), world_size=2)


@pytest.mark.parametrize("make", [sf.randn, sf.rand])
def test_random_values_need_a_floating_dtype(make):
    """torch refuses to draw randn / rand values of an integer dtype; sbpflow used to draw
    floats and truncate them."""
    ref = getattr(torch, make.__name__)
    with pytest.raises(RuntimeError):
        ref(4, 6, dtype=torch.int64)

    def body():
        make(4, 6, placement=sf.placement("cpu", [0, 1]), sbp=sf.S(0), dtype=torch.int64)
    with pytest.raises(sf.errors.DtypeMismatchError, match=r"\(4, 6\).*int64"):
        sf.launch(body, world_size=2)


def test_single_rank_without_launch():
    x = sf.randn(3, 4, seed=0)
    assert x.placement == sf.placement("cpu", [0]) and x.sbp == (sf.B,)
    assert torch.equal(x.to_global(sbp=sf.S(1)).full_tensor(), x.local)


def test_retain_grad_twice_keeps_the_gradient_as_torch():
    """torch allows retain_grad() twice; sbpflow's registry of retained gradients did not (a
    weak set compared the torch tensor with itself, elementwise)."""
    w0 = torch.arange(9.0).reshape(3, 3)
    pl = sf.placement("cpu", [0])
    w = sf.nn.Parameter(sf.tensor(w0, pl, (sf.B,)))
    y = w * 2
    y.retain_grad()
    y.retain_grad()
    (y * y).sum().backward()
    torch.testing.assert_close(y.grad.full_tensor(), 2 * (2 * w0))


def _filled_float64() -> list:
    pl = sf.placement("cpu", [0, 1])
    made = sf.full((3,), 0.1, placement=pl, sbp=sf.B, dtype=torch.float64)
    filled = sf.zeros(3, placement=pl, sbp=sf.S(0), dtype=torch.float64)
    filled.fill_(0.1)
    constant = sf.zeros(3, placement=pl, sbp=sf.B, dtype=torch.float64)
    sf.nn.init.constant_(constant, 0.1)
    return [t.full_tensor() for t in (made, filled, constant)]


def test_a_float64_fill_is_exact():
    """``sf.full``, ``fill_`` and ``init.constant_`` make the value in the tensor's dtype, as
    torch: 0.1 in float64 (it was made in float32 first: 0.1 + 1.5e-9)."""
    for t in sf.launch(_filled_float64, 2)[0]:
        assert torch.equal(t, torch.full((3,), 0.1, dtype=torch.float64))
