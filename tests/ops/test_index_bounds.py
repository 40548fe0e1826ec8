"""Issue 12: every index-taking op refuses out-of-range indices in every layout, as torch does.

Ops: embedding (ids B / S, table B / S(0) / S(1) / P), cross_entropy (logits B / S(rows) /
S(classes) / P, target B / S; plain, sum, none, class weights, label smoothing, (N, C, d)
logits), getitem and narrow. Meshes: 3 ranks and 2x2. Bad indices: just above the range, far
above, negative, below minus the range. The error is `IndexOutOfRange` (an `SbpError` and an
`IndexError`). Where the index is whole on every rank (``B`` on every mesh dim) every rank
raises, so none is left waiting in a collective; a split index raises on some rank (with a
replicated table, data parallelism: exactly the ranks holding it). Good calls (``ignore_index``, ``padding_idx`` including negative ones)
equal torch, values and gradients.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf
import sbpflow.nn.functional as SF
from sbpflow.errors import CommError, IndexOutOfRange
from sbpflow.sbp import Broadcast, shard_box
from sbptest import check_op, make_global

S, B, P = sf.S, sf.B, sf.P
MESH_1D, MESH_2D = [0, 1, 2], [[0, 1], [2, 3]]
VOCAB, CLASSES = 10, 5


def _ids(*shape, high=VOCAB, seed=0):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _t(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _with(values: torch.Tensor, pos: int, bad: int) -> torch.Tensor:
    out = values.clone()
    out.view(-1)[pos] = bad
    return out


def _holders(value: torch.Tensor, pos: int, pl, nd) -> set:
    """The ranks whose shard of ``value`` (laid out ``nd``) holds flat element ``pos``."""
    where = torch.unravel_index(torch.tensor(pos), value.shape)
    out = set()
    for r in pl.flat_ranks:
        box = shard_box(tuple(value.shape), pl.shape, nd, pl.coord_of(r))
        if all(s <= int(i) < s + n for (s, n), i in zip(box, where)):
            out.add(r)
    return out


def _verdicts(pl, calls: list, whole: bool) -> list[dict]:
    """Run each of ``calls`` (rank functions making one call with a bad index) on every rank;
    for each, the ranks that raised `IndexOutOfRange` (rank -> message). With ``whole`` the
    index is B everywhere, so every rank must raise at the same point: one launch runs all
    the calls, each rank catching. Otherwise a launch a call: the ranks that raise return,
    and a rank left waiting for them stops with a `CommError` (that rank returned)."""
    raised = [{} for _ in calls]

    def body(todo):
        for i in todo:
            try:
                calls[i]()
            except IndexOutOfRange as exc:
                assert isinstance(exc, IndexError) and isinstance(exc, sf.SbpError)
                raised[i][sf.rank()] = str(exc)
                if not whole:
                    return

    if whole:
        sf.launch(body, world_size=pl.size, args=(range(len(calls)),))
    else:
        for i in range(len(calls)):
            try:
                sf.launch(body, world_size=pl.size, args=([i],))
            except CommError:
                pass
    return raised


# -- the issue's two snippets ----------------------------------------------------------------------
def test_issue_snippets_raise_on_every_rank():
    mesh = sf.placement("cpu", ranks=[0, 1, 2, 3])
    outcomes = {}

    def body():
        out = []
        emb = sf.nn.Embedding(10, 4)
        sf.parallel.apply(emb, mesh, {"*": sf.S(0)})
        with pytest.raises(IndexError, match="12"):
            emb(sf.tensor(torch.tensor([1, 12, 3]), mesh, sf.B))
        out.append("embedding")
        logits = sf.randn(4, 5, placement=mesh, sbp=sf.S(1), seed=0)
        with pytest.raises(IndexError, match="9"):
            sf.nn.functional.cross_entropy(logits, sf.tensor(torch.tensor([0, 9, 1, 2]), mesh,
                                                             sf.B))
        out.append("cross_entropy")
        outcomes[sf.rank()] = out

    sf.launch(body, world_size=4)
    assert outcomes == {r: ["embedding", "cross_entropy"] for r in range(4)}


# -- embedding -------------------------------------------------------------------------------------
def _emb_layouts(pl):
    ids_1d = [B, S(0), S(1)]
    tables = [B, S(0), S(1), P]
    if pl.ndim == 1:
        return [((i,), (w,)) for i in ids_1d for w in tables]
    ids = [(B, B), (S(0), B), (B, S(0)), (S(1), S(0))]
    tabs = [(S(0), S(0)), (B, S(0)), (S(0), B), (S(1), S(0)), (S(0), S(1)), (B, B), (P, S(0))]
    return list(itertools.product(ids, tabs))


BAD_IDS = [VOCAB, 12, -1, -VOCAB - 1]


@pytest.mark.parametrize("ranks", [MESH_1D, MESH_2D], ids=["1d", "2x2"])
@pytest.mark.parametrize("param", [False, True], ids=["table", "parameter"])
def test_embedding_out_of_range_raises_in_every_layout(ranks, param):
    """A parameter table stays in place (the kernel checks); another may move instead of the
    ids (checked whole before the op)."""
    pl = sf.placement("cpu", ranks)
    table = _t(VOCAB, 3)
    good = _ids(4, 3)
    for ids_nd, w_nd in _emb_layouts(pl):
        whole = all(isinstance(s, Broadcast) for s in ids_nd)
        cases = [(bad, pos, _with(good, pos, bad)) for bad, pos in zip(BAD_IDS, (5, 0, 11, 7))]

        def call(ids, w_nd=w_nd, ids_nd=ids_nd):
            return lambda: SF.embedding(sf.tensor(ids, pl, ids_nd),
                                        make_global(table, pl, w_nd).requires_grad_(param))

        verdicts = _verdicts(pl, [call(ids) for _, _, ids in cases], whole)
        for (bad, pos, ids), raised in zip(cases, verdicts):
            where = f"ids {ids_nd}, table {w_nd}, bad id {bad}"
            if whole:
                assert set(raised) == set(pl.flat_ranks), where
            else:   # some rank raised (which: where the op's signature put that id)
                assert raised, where
            assert all(f"id {bad} is out of range" in m for m in raised.values()), where


@pytest.mark.parametrize("ranks", [MESH_1D, MESH_2D], ids=["1d", "2x2"])
def test_embedding_split_ids_raise_on_the_holding_rank(ranks):
    """ids split, table replicated (data parallel): the ranks holding the bad id raise."""
    pl = sf.placement("cpu", ranks)
    ids_nd = (S(0),) if pl.ndim == 1 else (S(0), S(1))
    ids = _with(_ids(4, 3), 11, 12)   # the last row: the last rank's shard
    raised = {}

    def body():
        try:
            SF.embedding(sf.tensor(ids, pl, ids_nd), sf.tensor(_t(VOCAB, 3), pl, (B,) * pl.ndim))
        except IndexOutOfRange:
            raised[sf.rank()] = True
            raise

    with pytest.raises(IndexOutOfRange, match="id 12 is out of range for a table of 10 rows"):
        sf.launch(body, world_size=pl.size)
    assert set(raised) == _holders(ids, 11, pl, ids_nd)


@pytest.mark.parametrize("ranks", [MESH_1D, MESH_2D], ids=["1d", "2x2"])
@pytest.mark.parametrize("padding_idx", [None, 3, -1, -VOCAB])
def test_embedding_good_ids_and_padding_equal_torch(ranks, padding_idx):
    """Values and the table's gradient (none for the padding row) equal torch's; the padding
    id itself is a valid id, negative ``padding_idx`` counts from the end as in torch."""
    pl = sf.placement("cpu", ranks)
    ids = _ids(4, 3)
    ids.view(-1)[:3] = torch.tensor([0, VOCAB - 1, (padding_idx or 0) % VOCAB])
    layouts = _emb_layouts(pl)

    def body():
        return check_op(lambda i, w: SF.embedding(i, w, padding_idx),
                        lambda i, w: F.embedding(i, w, padding_idx), (ids, _t(VOCAB, 3)), pl,
                        layouts)

    failures = sf.launch(body, world_size=pl.size)[0]
    assert not failures, failures[:3]


def test_embedding_module_padding_idx_negative_is_normalised():
    pl = sf.placement("cpu", MESH_1D)

    def body():
        emb = sf.nn.Embedding(VOCAB, 3, padding_idx=-2)
        sf.parallel.apply(emb, pl, {"*": S(0)})
        ids = torch.tensor([[8, 1], [0, 9]])
        out = emb(sf.tensor(ids, pl, B)).full_tensor()
        ref = F.embedding(ids, emb.weight.full_tensor(), padding_idx=-2)
        with pytest.raises(IndexError):
            emb(sf.tensor(torch.tensor([[-2, 1]]), pl, B))   # a negative id, as torch
        return emb.padding_idx, torch.equal(out, ref), bool((out[0, 0] == 0).all())

    assert sf.launch(body, world_size=3) == [(8, True, True)] * 3


# -- cross-entropy ---------------------------------------------------------------------------------
def _ce_layouts(pl):
    """(logits nd-sbp, target nd-sbp) for (N, C) logits."""
    if pl.ndim == 1:
        return [((lg,), (t,)) for lg in (B, S(0), S(1), P) for t in (B, S(0))]
    return [((S(1), S(1)), (B, B)), ((S(0), S(1)), (S(0), B)), ((B, S(1)), (B, B)),
            ((S(0), S(0)), (B, B)), ((S(0), B), (B, B)), ((B, B), (B, B)),
            ((P, S(1)), (B, B)), ((S(0), S(0)), (S(0), S(0))), ((S(1), S(0)), (B, S(0)))]


CE_VARIANTS = {
    "mean": {}, "sum": {"reduction": "sum"}, "none": {"reduction": "none"},
    "weight": {"weight": True}, "smoothing": {"label_smoothing": 0.1},
    "ignore-3": {"ignore_index": -3},
}
# (bad target, flat position, extra kwargs): above, far above, negative, the default
# ignore_index when another one is given
BAD_TARGETS = [(CLASSES, 6, {}), (9, 0, {}), (-1, 3, {}), (-100, 5, {"ignore_index": -3})]


def _ce(pl, logits, target, kw, lg_nd, t_nd, seed=0):
    """sf cross_entropy of global copies laid out (lg_nd, t_nd); ``weight=True``: fixed class
    weights."""
    kw = dict(kw)
    if kw.get("weight") is True:
        kw["weight"] = sf.tensor(torch.rand(CLASSES, dtype=torch.float64,
                                            generator=torch.Generator().manual_seed(1)), pl,
                                 (B,) * pl.ndim)
    return SF.cross_entropy(make_global(logits, pl, lg_nd, seed), sf.tensor(target, pl, t_nd),
                            **kw)


@pytest.mark.parametrize("ranks", [MESH_1D, MESH_2D], ids=["1d", "2x2"])
def test_cross_entropy_out_of_range_raises_in_every_layout(ranks):
    pl = sf.placement("cpu", ranks)
    logits = _t(7, CLASSES)
    good = _ids(7, high=CLASSES)
    for lg_nd, t_nd in _ce_layouts(pl):
        whole = all(isinstance(s, Broadcast) for s in t_nd)
        cases = [(vname, bad, pos, {**kw, **extra}, _with(good, pos, bad))
                 for vname, kw in CE_VARIANTS.items() for bad, pos, extra in BAD_TARGETS]

        def call(target, kws, lg_nd=lg_nd, t_nd=t_nd):
            return lambda: _ce(pl, logits, target, kws, lg_nd, t_nd)

        verdicts = _verdicts(pl, [call(c[4], c[3]) for c in cases], whole)
        for (vname, bad, pos, _, target), raised in zip(cases, verdicts):
            where = f"logits {lg_nd}, target {t_nd}, {vname}, bad target {bad}"
            if whole:
                assert set(raised) == set(pl.flat_ranks), where
            else:
                assert raised, where
            assert all(f"Target {bad} is out of bounds" in m for m in raised.values()), where


@pytest.mark.parametrize("ranks", [MESH_1D, MESH_2D], ids=["1d", "2x2"])
def test_cross_entropy_ignore_index_equals_torch(ranks):
    """Targets equal to ignore_index (default -100, a negative one, one inside the classes,
    one above them) are skipped as torch skips them, in every layout and variant."""
    pl = sf.placement("cpu", ranks)
    logits = _t(7, CLASSES)
    cases = [(-100, [1, 5]), (-3, [0, 6]), (2, [3]), (CLASSES + 2, [4, 2])]
    weight = torch.rand(CLASSES, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def body():
        failures = []
        for ignore, positions in cases:
            target = _ids(7, high=CLASSES)
            target[positions] = ignore
            for vname, kw in CE_VARIANTS.items():
                kw = {k: v for k, v in kw.items() if k != "ignore_index"}
                ref_kw = {**kw, "weight": weight} if kw.get("weight") else kw
                for lg_nd, t_nd in _ce_layouts(pl):
                    got = _ce(pl, logits, target, {**kw, "ignore_index": ignore}, lg_nd, t_nd)
                    ref = F.cross_entropy(logits, target, ignore_index=ignore, **ref_kw)
                    if not torch.allclose(got.full_tensor(), ref, atol=1e-10):
                        failures.append((ignore, vname, lg_nd, t_nd))
        return failures

    failures = sf.launch(body, world_size=pl.size)[0]
    assert not failures, failures[:5]


def test_cross_entropy_spatial_logits_out_of_range():
    """(N, C, d) logits, classes on axis 1 split: a bad target raises on every rank; good
    targets (with ignore_index) equal torch, gradient included."""
    pl = sf.placement("cpu", MESH_1D)
    logits = _t(2, CLASSES, 3)
    target = _ids(2, 3, high=CLASSES)
    target[0, 1] = -100
    bad = _with(target, 4, CLASSES)

    def good():
        return check_op(SF.cross_entropy, F.cross_entropy, (logits, target), pl,
                        [((S(1),), (B,)), ((S(0),), (S(0),)), ((S(2),), (S(1),))])

    assert not sf.launch(good, world_size=3)[0]
    raised = _verdicts(pl, [lambda: SF.cross_entropy(make_global(logits, pl, (S(1),)),
                                                     sf.tensor(bad, pl, B))], True)
    assert set(raised[0]) == {0, 1, 2}


# -- getitem / narrow ------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [MESH_1D, MESH_2D], ids=["1d", "2x2"])
def test_getitem_and_narrow_out_of_range_raise_index_error(ranks):
    pl = sf.placement("cpu", ranks)
    value = _t(VOCAB, 4)
    layouts = [(B,), (S(0),), (S(1),), (P,)] if pl.ndim == 1 else \
        [(S(0), S(1)), (B, S(0)), (P, S(1))]
    bad = [lambda x: x[VOCAB], lambda x: x[-VOCAB - 1], lambda x: x[:, 4], lambda x: x[1, -5],
           lambda x: x[None, 12], lambda x: x.narrow(0, VOCAB + 1, 1)]
    good = [lambda x: x[-1], lambda x: x[VOCAB - 1], lambda x: x[:, -4], lambda x: x[3:99],
            lambda x: x.narrow(0, -2, 2), lambda x: x.narrow(1, 4, 0)]

    def body():
        failures = []
        for nd in layouts:
            x = make_global(value, pl, nd)
            for i, f in enumerate(bad):
                try:
                    f(x)
                    failures.append(("no error", nd, i))
                except IndexOutOfRange as exc:
                    if not isinstance(exc, IndexError):
                        failures.append(("type", nd, i))
                    if sf.sbp.format_nd_sbp(nd) not in str(exc) or str(pl) not in str(exc):
                        failures.append(("message names no layout", nd, i, str(exc)))
            for i, f in enumerate(good):
                if not torch.allclose(f(x).full_tensor(), f(value), atol=1e-12):
                    failures.append(("value", nd, i))
        return failures

    results = sf.launch(body, world_size=pl.size)
    assert results == [[]] * pl.size, results[0][:5]


# -- real processes --------------------------------------------------------------------------------
@pytest.mark.gloo
def test_issue_snippets_raise_on_every_gloo_rank():
    """On gloo processes no launcher abort stops a rank that did not raise: every rank must
    reach the same verdict by itself, and go on to the same next collective."""
    from index_bounds_fns import split_table_and_classes_verdicts
    got = sf.launch(split_table_and_classes_verdicts, world_size=4, backend="torch", timeout=60)
    assert got == [["raised", "raised"]] * 4
