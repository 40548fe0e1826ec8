"""Mixed input dtypes: ops whose torch kernel needs one dtype (matmul, linear, conv2d, ...) raise
`sf.errors.DtypeMismatchError` on every rank, naming the inputs' dtypes, shapes, placements and sbps;
torch's autocast casts are honoured; ops that promote in torch promote here too."""

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf

MESH = [[0, 1], [2, 3]]


def _t(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _every_rank_raises(fn, tensors, sbps):
    """Run ``fn`` on global copies of ``tensors``; return each rank's (error type, message)."""
    def body():
        mesh = sf.placement("cpu", ranks=MESH)
        args = [sf.tensor(t, mesh, s) for t, s in zip(tensors, sbps)]
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return type(exc), str(exc)
        return None, ""
    return sf.launch(body, world_size=4)


FNS = {"matmul": lambda a, b: a @ b, "linear": sf.nn.functional.linear,
       "conv2d": sf.nn.functional_conv.conv2d}
CASES = [
    ("matmul", torch.matmul, [_t(4, 6), _t(6, 5, seed=1, dtype=torch.float64)],
     [(sf.S(0), sf.B), (sf.B, sf.S(1))]),
    ("linear", F.linear, [_t(4, 6), _t(5, 6, seed=1), _t(5, seed=2, dtype=torch.float64)],
     [(sf.S(0), sf.B), (sf.B, sf.S(0)), (sf.B, sf.S(0))]),
    ("matmul", torch.matmul, [_t(4, 6, dtype=torch.bfloat16), _t(6, 5, seed=1)],
     [(sf.B, sf.B), (sf.B, sf.B)]),
    ("conv2d", F.conv2d, [_t(2, 3, 5, 5), _t(4, 3, 3, 3, seed=1, dtype=torch.float64)],
     [(sf.S(0), sf.B), (sf.B, sf.S(0))]),
]


@pytest.mark.parametrize("name,ref,tensors,sbps", CASES, ids=[f"{c[0]}-{i}" for i, c in
                                                                enumerate(CASES)])
def test_mixed_dtypes_raise_on_every_rank_naming_the_inputs(name, ref, tensors, sbps):
    with pytest.raises(RuntimeError):  # torch refuses them too: we follow it
        ref(*tensors)
    results = _every_rank_raises(FNS[name], tensors, sbps)
    for kind, msg in results:
        assert kind is sf.errors.DtypeMismatchError, msg
        assert issubclass(kind, sf.SbpError) and issubclass(kind, RuntimeError)
        for t, s in zip(tensors, sbps):
            assert str(t.dtype) in msg and str(tuple(t.shape)) in msg
            assert sf.sbp.format_nd_sbp(s) in msg
        assert "cpu[[0,1],[2,3]]" in msg  # the placement


def test_autocast_casts_before_the_check():
    """Under CPU autocast, float32 @ bfloat16 runs in bfloat16 (as torch); float64 is not cast
    by autocast, so float32 @ float64 still raises (as torch)."""
    a, b = _t(4, 6), _t(6, 5, seed=1, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.matmul(a, b)
        with pytest.raises(RuntimeError):
            torch.matmul(a, b.double())

    def body():
        mesh = sf.placement("cpu", ranks=MESH)
        x, w = sf.tensor(a, mesh, (sf.S(0), sf.B)), sf.tensor(b, mesh, (sf.B, sf.S(1)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = (x @ w).full_tensor()
            try:
                x @ w.to(torch.float64)
            except sf.errors.DtypeMismatchError:
                return got
        raise AssertionError("float32 @ float64 under autocast did not raise")

    for got in sf.launch(body, world_size=4):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want)


def test_mixed_dtypes_after_a_clean_call_with_the_same_layouts_still_raise():
    """The dispatch caches per input metadata: a good call first must not let a bad one pass."""
    a = _t(4, 6)

    def body():
        mesh = sf.placement("cpu", ranks=MESH)
        x = sf.tensor(a, mesh, (sf.S(0), sf.B))
        w = sf.tensor(a.t().contiguous(), mesh, (sf.B, sf.B))
        x @ w
        with pytest.raises(sf.errors.DtypeMismatchError):
            x @ w.to(torch.float64)
        return True

    assert all(sf.launch(body, world_size=4))


def test_elementwise_ops_promote_as_torch():
    a, b = _t(4, 6), _t(4, 6, seed=1, dtype=torch.float64)

    def body():
        mesh = sf.placement("cpu", ranks=MESH)
        return (sf.tensor(a, mesh, (sf.S(0), sf.B)) + sf.tensor(b, mesh, (sf.B, sf.S(1)))) \
            .full_tensor()

    for got in sf.launch(body, world_size=4):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, a + b)
