"""The analytic price's reduce-then-transfer (nested splits after partial sums) takes the
reduced layout that moves the fewest bytes per device, the first of the options on a tie,
as the boxing planner does. `_via_transfer` finds a transfer's loads only for options
whose reduction alone can still beat the best total; here every option is priced in full
and the first least total must be the one it chose."""

import importlib
import itertools
import math

import pytest

from sbpflow.sbp import B, P, S

E = importlib.import_module("sbpflow.auto.evaluate")


def _first_fewest_bytes(shape, fine, s, d) -> tuple:
    """Every option of `_transfer_options` priced in full; the moves of the first whose
    bytes per device are least."""
    how, sk = E._skeleton(len(shape), fine, s, fine, d)
    assert how == "transfer"
    fine, s, d, ndim, options = sk
    numel = math.prod(shape)
    best = None
    for spec, mid, _ in options:
        moves, vol = [], 0
        if spec is not None:
            kind, pdims, div, ax = spec
            local = E._local_shape(shape, fine, s)
            copy = math.prod(local) if kind == "reduce_scatter" and E._strided(local, ax) \
                else 0.0
            moves.append(E.Move(kind, fine, pdims, numel / div, copy))
            vol = E._per_device(kind, numel / div, math.prod(fine[j] for j in pdims))
        front = E._transfer_fraction(fine, mid, d, ndim)
        if front:
            moves += E._sized_transfer(fine, numel, front)
            vol += front[0][0] * numel
        if best is None or vol < best[0]:
            best = (vol, tuple(moves))
    return best[1]


@pytest.mark.parametrize("fine", [(2, 2, 2), (4, 2), (2, 4)])
def test_reduce_then_transfer_takes_the_first_fewest_bytes(fine):
    shape = (24, 40)
    sources = [s for s in itertools.product((S(0), S(1), B, P), repeat=len(fine)) if P in s]
    targets = list(itertools.product((S(0), S(1), B), repeat=len(fine)))
    checked = 0
    for s, d in itertools.product(sources, targets):
        if E._skeleton(2, fine, s, fine, d)[0] != "transfer":
            continue
        assert E._plan(shape, fine, s, fine, d) == _first_fewest_bytes(shape, fine, s, d), \
            (fine, s, d)
        checked += 1
    assert checked >= 10   # nested splits after a reduction are common on these meshes
