"""Which rank holds a partial value (sbpflow.sbp.holds_value): one rule for creation ops,
sf.nn.init, checkpoint loading and boxing B -> P. Along P(sum) only coordinate 0 holds the
value, the others zeros; along P(max)/P(min) every rank holds it: no shard holds an infinity,
and every layout, mixed ones included, has the logical value it was given."""

import pytest
import torch

import sbpflow as sf
from sbpflow.sbp import holds_value

MESH = [[0, 1], [2, 3]]
LAYOUTS = [(sf.P("max"), sf.B), (sf.P("min"), sf.P("max")), (sf.P("max"), sf.P),
           (sf.P, sf.P("max")), (sf.P("min"), sf.P), (sf.P, sf.P)]


def test_the_rule():
    assert holds_value((sf.P, sf.B), (0, 1)) and not holds_value((sf.P, sf.B), (1, 0))
    assert holds_value((sf.P("max"), sf.P("min")), (1, 1))
    assert not holds_value((sf.P("max"), sf.P), (0, 1))
    assert holds_value((sf.P("max"), sf.P), (0, 1), dims=[0])


def _value(seed):
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sbp", LAYOUTS, ids=[sf.sbp.format_nd_sbp(s) for s in LAYOUTS])
def test_created_initialised_boxed_values(sbp):
    want = sf.launch(lambda: sf.randn(3, 5, seed=7).full_tensor(), world_size=4)[0]

    def body():
        mesh = sf.placement("cpu", ranks=MESH)
        made = [sf.randn(3, 5, placement=mesh, sbp=sbp, seed=7),
                sf.tensor(want, mesh, sbp),
                sf.nn.init.normal_(sf.zeros(3, 5, placement=mesh, sbp=sbp), seed=7),
                sf.tensor(want, mesh, (sf.B, sf.B)).to_global(sbp=sbp)]
        full = sf.full((2,), -3.0, placement=mesh, sbp=sbp)
        assert all(torch.isfinite(t.local).all() for t in made + [full])
        return [t.full_tensor() for t in made], full.full_tensor()

    for values, full in sf.launch(body, world_size=4):
        for v in values:
            torch.testing.assert_close(v, want)
        assert torch.equal(full, torch.full((2,), -3.0))


class _Holder(sf.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = sf.nn.Parameter(w)


@pytest.mark.parametrize("saved,sbp", [
    ((sf.P("max"), sf.B), (sf.P("max"), sf.B)), ((sf.P("min"), sf.P("min")), (sf.P("min"), sf.P("min"))),
    ((sf.P, sf.B), (sf.P, sf.B)), ((sf.B, sf.B), (sf.P, sf.P("max"))),
    ((sf.S(0), sf.B), (sf.P("max"), sf.P)), ((sf.P("max"), sf.B), (sf.P, sf.P("min")))],
    ids=["Pmax-B", "Pmin-Pmin", "P-B", "into-P-Pmax", "into-Pmax-P", "Pmax-into-P-Pmin"])
def test_saved_and_loaded_partial_keeps_its_value(saved, sbp, tmp_path):
    """Saved in one layout, loaded into another (mixed partial layouts too): the logical value,
    negative entries included, is the saved one and no shard holds an infinity."""
    value = _value(3) - 1.0

    def body():
        mesh = sf.placement("cpu", ranks=MESH)
        src = _Holder(sf.tensor(value, mesh, saved))
        sf.save(str(tmp_path / "ckpt"), src)
        dst = _Holder(sf.zeros(3, 5, placement=mesh, sbp=sbp))
        sf.load(str(tmp_path / "ckpt"), dst)
        assert torch.isfinite(dst.w.local).all()
        return dst.w.full_tensor()

    for got in sf.launch(body, world_size=4):
        torch.testing.assert_close(got, value)
