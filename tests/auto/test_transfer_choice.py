"""The analytic price's reduce-then-transfer (nested splits after partial sums) takes the
reduced layout that moves the fewest bytes per device, the first of the options on a tie,
as the boxing planner does. `_via_transfer` finds a transfer's loads only for options
whose reduction alone can still beat the best total; here every option is priced in full
and the first least total must be the one it chose."""

import collections
import importlib
import itertools
import math
import random

import pytest

from sbpflow.sbp import B, P, S, shard_box

E = importlib.import_module("sbpflow.auto.redistribution_price")
TL = importlib.import_module("sbpflow.auto.transfer_loads")


def _first_fewest_bytes(shape, fine, s, d) -> tuple:
    """Every option of `walk._transfer_options` priced in full; the moves of the first whose
    bytes per device are least."""
    how, sk = E.find_walk(len(shape), fine, s, fine, d)
    assert how == "transfer"
    fine, s, d, ndim, options = sk.fine, sk.src, sk.dst, sk.ndim, sk.options
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
        front = TL.transfer_fraction(fine, mid, d, ndim)
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
        if E.find_walk(2, fine, s, fine, d).how != "transfer":
            continue
        assert E._plan(shape, fine, s, fine, d) == _first_fewest_bytes(shape, fine, s, d), \
            (fine, s, d)
        checked += 1
    assert checked >= 10   # nested splits after a reduction are common on these meshes


def _front_by_hand(shape, fine, src, dst) -> tuple:
    """`transfer_fraction`'s front from the ranks' integer boxes (`shard_box`): per
    receiving rank the elements of its destination box it does not hold (a fraction of the
    tensor) and the distinct source boxes it meets, less its own; the (elements, messages)
    pairs not dominated by another, most elements first."""
    numel = math.prod(shape)
    coords = list(itertools.product(*[range(m) for m in fine]))
    boxes = {shard_box(shape, fine, src, c) for c in coords}

    def meet(a, b):
        return math.prod(max(0, min(x + n, y + k) - max(x, y)) for (x, n), (y, k) in zip(a, b))
    loads = set()
    for c in coords:
        if any(isinstance(x, type(P)) and x.op == "sum" and i for x, i in zip(dst, c)):
            continue   # a non-first rank of a P(sum) dim holds zeros: it receives nothing
        want, have = shard_box(shape, fine, dst, c), shard_box(shape, fine, src, c)
        lack = math.prod(n for _, n in want) - meet(want, have)
        if lack:
            msgs = sum(meet(want, b) > 0 for b in boxes) - (meet(want, have) > 0)
            loads.add((round(lack / numel, 12), msgs))
    front = []
    for e, m in sorted(loads, reverse=True):
        if not front or m > front[-1][1]:
            front.append((e, m))
    return tuple(front)


@pytest.mark.parametrize("kept", [1 << 14, 5])
def test_transfer_loads_are_the_ranks_own(kept, monkeypatch):
    """`transfer_fraction` (per-axis arrays; the front taken from the busiest rank when it
    dominates) equals the front found from every rank's integer boxes, on meshes where
    some fronts have one point and some several; found one pair at a time, and in one
    batch of every pair (`find_fractions`: meshes of 6, 8 and 12 ranks mixed); with
    ``kept`` 5, the box tables start afresh on most batches and grow past it in the big
    one."""
    monkeypatch.setattr(TL, "_BOX_ROWS_KEPT", kept)
    TL._BOX_TABLES.clear()
    shape = (24, 48)   # every split even (the fractions assume even parts)
    keys = [(fine, src, dst, 2) for fine in [(2, 2, 2), (4, 2), (2, 3), (3, 2, 2)]
            for src in itertools.product((S(0), S(1), B), repeat=len(fine))
            for dst in itertools.product((S(0), S(1), B, P), repeat=len(fine))]
    want = {k: _front_by_hand(shape, *k[:3]) for k in keys}
    sizes = collections.Counter(min(len(f), 2) for f in want.values())
    assert sizes[1] > 100 and sizes[2] > 10, sizes
    for batch in ([[k] for k in keys], [keys]):
        TL._FRACTIONS.clear()
        for b in batch:
            TL.find_fractions(b)
        assert len(TL._FRACTIONS) == len(keys)
        for k in keys:
            assert TL.transfer_fraction(*k) == want[k], k


def test_transfer_loads_found_by_concurrent_threads_are_each_ranks_own(monkeypatch):
    """Searches run in rank threads at once (`sf.auto.parallelize` inside `sf.launch`), and
    the box tables are shared: batches found concurrently, the tables starting afresh
    often (few rows kept), must each give the fronts of the ranks' integer boxes."""
    import threading
    monkeypatch.setattr(TL, "_BOX_ROWS_KEPT", 24)
    shape = (24, 48)
    keys = [(fine, src, dst, 2) for fine in [(2, 2, 2), (4, 2), (2, 4)]
            for src in itertools.product((S(0), S(1), B), repeat=len(fine))
            for dst in itertools.product((S(0), S(1), B, P), repeat=len(fine))]
    want = {k: _front_by_hand(shape, *k[:3]) for k in keys}
    wrong, errors = [], []

    def work(seed):
        try:
            order = list(keys)
            random.Random(seed).shuffle(order)
            for i in range(0, len(order), 7):
                batch = order[i:i + 7]
                for k in batch:
                    TL._FRACTIONS.pop(k, None)
                TL.find_fractions(batch)
                wrong.extend(k for k in batch if TL._FRACTIONS.get(k, want[k]) != want[k])
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong, (errors[:1], wrong[:3])
