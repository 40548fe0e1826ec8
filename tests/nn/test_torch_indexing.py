"""Torch's indexing and writes as transformers' generate() uses them, on global tensors against
plain torch on one device: advanced indexing (index tensors, lists, bool masks; gradients), a
plain torch tensor written with global values (``buf[:, :n] = ids``, ``copy_``, ``add_``), numpy's
argument names (``torch.all(x, axis=-1, keepdims=True)``), a 0-d integer tensor as an index
(``x[:, :n]``), and ``gather`` / ``take_along_dim`` with the input replicated and the index split
(beam search's ``_gather_beams``)."""

import operator
import warnings

import pytest
import torch

import sbpflow as sf
from sbpflow.nn.torch_fallback import ReplicatedFallbackWarning

F64 = torch.float64
X = torch.randn(4, 6, dtype=F64, generator=torch.Generator().manual_seed(0))
LAYOUTS = [sf.S(0), sf.S(1), sf.B]
BATCH = torch.arange(4)[:, None, None, None]
KV = torch.arange(5)[None, None, None, :]


def _idx(x, *values):
    """``values`` as global tensors where ``x`` is one (laid out B), else plain."""
    if isinstance(x, sf.GlobalTensor):
        return [sf.tensor(v, x.placement, sf.B) for v in values]
    return list(values)


CASES = {   # name -> fn(x): a value of x (global or plain), torch's meaning
    "mask_of_aranges": lambda x: x[BATCH, KV],               # transformers' padding mask
    "lists": lambda x: x[[0, 2, 3], [1, 5, 0]],
    "tensor_then_slice": lambda x: x[torch.tensor([3, 0, 3]), 1:4],
    "slice_then_tensor": lambda x: x[:, torch.tensor([[5, 0], [2, 2]])],
    "ellipsis_none": lambda x: x[..., None, torch.tensor([1, 4])],
    "bool_mask": lambda x: x[x > 0.3],
    "plain_row_mask": lambda x: x[torch.tensor([True, False, True, True])],
    "bool_item": lambda x: x[True],
    "global_indices": lambda x: x[tuple(_idx(x, torch.tensor([1, 3]), torch.tensor([0, 5])))],
    "rows_by_global": lambda x: x[_idx(x, torch.tensor([2, 2, 0]))[0]],
    "gradient": lambda x: _grad_of(x, lambda t: (t[BATCH, KV] ** 2).sum()),
}


def _grad_of(x, loss_fn):
    leaf = x.detach().clone().requires_grad_()
    loss_fn(leaf).backward()
    return leaf.grad


def _value(v):
    return v.full_tensor() if isinstance(v, sf.GlobalTensor) else v


def test_advanced_indexing_as_torch():
    def body():
        pl = sf.placement("cpu", [0, 1])
        bad = []
        for sbp in LAYOUTS:
            for name, fn in CASES.items():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ReplicatedFallbackWarning)
                    got = _value(fn(sf.tensor(X, pl, sbp)))
                want = fn(X.clone())
                if got.dtype != want.dtype or not torch.equal(got, want):
                    bad.append((name, sbp, got))
        plain = X[sf.tensor(torch.tensor([3, 1]), pl, sf.S(0))]   # a torch tensor indexed
        return bad, _value(plain)
    bad, plain = sf.launch(body, world_size=2)[0]
    assert bad == []
    assert torch.equal(plain, X[torch.tensor([3, 1])])


def _writes(ids):
    """generate()'s buffers: torch tensors made with torch.full, written with (global) ids."""
    buf = torch.full((4, 3, 9), -1, dtype=torch.int64)
    buf[:, :, :5] = ids.view(4, 3, 5)
    copied = torch.zeros(12, 5, dtype=torch.int64)
    copied.copy_(ids)
    copied.add_(ids)
    copied[ids > 30] = 0
    flags = torch.zeros(12, dtype=torch.bool)
    flags |= ids[:, 0] > 20
    return buf, copied, flags


def test_plain_tensors_take_global_values_as_torch():
    ids = torch.randint(0, 64, (12, 5), generator=torch.Generator().manual_seed(1))

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        return [_writes(sf.tensor(ids, pl, sbp)) for sbp in (sf.S(0), sf.S(1), sf.B)]
    with pytest.warns(ReplicatedFallbackWarning, match="into a plain torch tensor"):
        results = sf.launch(body, world_size=4)[0]
    want = _writes(ids)
    for got in results:
        assert all(type(g) is torch.Tensor and torch.equal(g, w) for g, w in zip(got, want))


_LENGTHS = torch.tensor([X.shape[0] - 3, 0, 3])


def _numpy_names(x):
    mask = x > 0
    return (torch.all(mask, axis=-1, keepdims=True), torch.any(mask, axis=0),
            torch.sum(x, axis=1), torch.amax(x, axis=0, keepdims=True), x.sum(axis=1),
            x.mean(axis=0, keepdims=True), x.softmax(axis=1), mask.any(axis=1),
            torch.segment_reduce(x, "sum", lengths=_LENGTHS, axis=0))  # (its own axis=)


def test_numpy_argument_names_and_tensor_index_as_torch():
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.tensor(X, pl, sf.S(0))
        n = sf.tensor(torch.tensor(4), pl, sf.B)
        try:
            float_index = operator.index(sf.tensor(torch.tensor(1.0), pl, sf.B))
        except TypeError as exc:
            float_index = str(exc)
        return ([_value(v) for v in _numpy_names(x)], _value(x[:, :n]), list(range(n)),
                float_index)
    got, sliced, listed, float_index = sf.launch(body, world_size=2)[0]
    want = _numpy_names(X)
    assert all(g.dtype == w.dtype and torch.allclose(g, w, rtol=1e-12, atol=0)
               for g, w in zip(got, want))
    assert torch.equal(sliced, X[:, :4]) and listed == [0, 1, 2, 3]
    assert "only integer tensors of a single element" in float_index   # torch's refusal


def _gather_beams(tensor, beam_indices):   # transformers' GenerationMixin._gather_beams
    while len(beam_indices.shape) < len(tensor.shape):
        beam_indices = beam_indices.unsqueeze(-1)
    return torch.take_along_dim(input=tensor, indices=beam_indices, dim=1)


def test_gather_of_replicated_input_by_split_index_as_torch():
    seqs = torch.arange(4 * 3 * 9).reshape(4, 3, 9)
    picks = torch.tensor([[0, 2, 1, 1, 0, 2], [1, 1, 1, 0, 0, 2], [2, 2, 0, 0, 1, 1],
                          [0, 0, 0, 1, 1, 2]])

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        index = sf.tensor(picks, pl, sf.S(0))
        return [_value(_gather_beams(s, index)) for s in
                (seqs, sf.tensor(seqs, pl, sf.B), sf.tensor(seqs, pl, sf.S(0)))] + \
            [_value(torch.gather(sf.tensor(seqs, pl, sf.B), 1, index[:, :3, None].expand(4, 3, 9)))]
    got = sf.launch(body, world_size=4)[0]
    want = _gather_beams(seqs, picks)
    assert all(torch.equal(g, want) for g in got[:3])
    assert torch.equal(got[3], torch.gather(seqs, 1, picks[:, :3, None].expand(4, 3, 9)))


def test_own_rows_picked_in_order_stay_split_and_gather_nothing():
    """``mask[batch_idx, kv_idx]`` on a mask split by rows (transformers' padding mask), and
    ``x[arange(n), cols]``: each rank indexes its own rows, the result split, no fallback bytes;
    rows picked out of order are gathered (and right)."""
    mask = X > 0

    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        out = {}
        for name, fn in {"mask": lambda m: m[BATCH, torch.arange(6)[None, None, None, :]],
                         "cols": lambda m: m[torch.arange(4), torch.tensor([5, 0, 2, 2])],
                         "reversed": lambda m: m[torch.arange(3, -1, -1), torch.arange(4)]
                         }.items():
            sf.comm.reset_stats()
            got = fn(sf.tensor(mask, pl, sf.S(0)))
            out[name] = (got.full_tensor(), got.sbp, "fallback" in str(sf.comm.stats()))
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedFallbackWarning)
        got = sf.launch(body, world_size=4)[0]
    assert torch.equal(got["mask"][0], mask[BATCH, torch.arange(6)[None, None, None, :]])
    assert torch.equal(got["cols"][0], mask[torch.arange(4), torch.tensor([5, 0, 2, 2])])
    assert torch.equal(got["reversed"][0], mask[torch.arange(3, -1, -1), torch.arange(4)])
    assert got["mask"][1:] == ((sf.S(0),), False) and got["cols"][1:] == ((sf.S(0),), False)
    assert got["reversed"][1:] == ((sf.B,), True)
