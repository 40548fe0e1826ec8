"""Hot torch functions of real models run by their own rules, nothing gathered
(sbpflow/ops/along.py and select.py, the decompositions of sbpflow/nn/torch_handlers.py): values and gradients
equal plain torch's (float64) on 4 rank threads, in several layouts, the output laid out as
expected and no 'fallback' bytes (docs/torch_models.md, 'What runs')."""

import pytest
import torch
import torch.nn.functional as F

import sbpflow as sf

F64 = torch.float64
G = torch.Generator().manual_seed(35)
S0, S1, S2, S3, B = sf.S(0), sf.S(1), sf.S(2), sf.S(3), sf.B


def _r(*shape):
    return torch.randn(*shape, generator=G, dtype=F64)


def _idx(rows, cols, n):  # distinct indices in [0, n) on each row
    return torch.stack([torch.randperm(n, generator=G)[:cols] for _ in range(rows)])


EMPTY = torch.tensor([], dtype=F64)

# name -> (function, inputs, [(input layouts, output layout), ...])
CASES = {
    "addmm": (lambda b, x, w: torch.addmm(b, x, w), (_r(8), _r(8, 5), _r(5, 8)),
              [((B, S0, B), S0), ((S0, B, S1), S1), ((B, B, B), B)]),
    "addmm beta alpha": (lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0),
                         (_r(8, 8), _r(8, 5), _r(5, 8)), [((S0, S0, B), S0), ((B, B, B), B)]),
    "addmm method": (lambda b, x, w: b.addmm(x, w), (_r(8), _r(8, 5), _r(5, 8)),
                     [((B, S0, B), S0)]),
    "baddbmm": (lambda i, a, b: torch.baddbmm(i, a, b, alpha=0.5), (_r(4, 3, 5), _r(4, 3, 6),
                                                                    _r(4, 6, 5)),
                [((S0, S0, S0), S0), ((B, B, B), B)]),
    "baddbmm keywords": (lambda i, a, b: torch.baddbmm(i, batch1=a, batch2=b, beta=0.5,
                                                      alpha=2.0),   # BLOOM's alibi attention
                         (_r(4, 3, 5), _r(4, 3, 6), _r(4, 6, 5)), [((S0, S0, S0), S0)]),
    "addmm keywords": (lambda b, x, w: torch.addmm(input=b, mat1=x, mat2=w), (_r(8), _r(8, 5),
                                                                         _r(5, 8)),
                       [((B, S0, B), S0)]),
    "addmv keywords": (lambda i, m, v: i.addmv(mat=m, vec=v, alpha=3.0), (_r(8), _r(8, 6), _r(6)),
                       [((S0, S0, B), S0)]),
    "addmv": (lambda i, m, v: torch.addmv(i, m, v), (_r(8), _r(8, 6), _r(6)),
              [((S0, S0, B), S0), ((B, B, B), B)]),
    "pad": (lambda x: F.pad(x, (1, 2)), (_r(8, 6, 4),), [((S0,), S0), ((S1,), S1), ((B,), B)]),
    "pad value": (lambda x: F.pad(x, (0, 0, 2, 1), value=1.5), (_r(8, 6, 4),),
                  [((S0,), S0), ((S2,), S2)]),
    "pad reflect": (lambda x: F.pad(x, (1, 1, 2, 0), mode="reflect"), (_r(4, 4, 6, 5),),
                    [((S0,), S0), ((S1,), S1)]),
    "cumsum": (lambda x: torch.cumsum(x, 1), (_r(8, 6, 4),),
               [((S0,), S0), ((S2,), S2), ((B,), B)]),
    "cumprod method": (lambda x: x.cumprod(-1), (_r(8, 6, 4),), [((S0,), S0), ((S1,), S1)]),
    "isin": (lambda e, t: torch.isin(e, t), (torch.randint(0, 9, (8, 6), generator=G),
                                             torch.tensor([1, 4, 7])),
             [((S0, B), S0), ((S1, B), S1), ((B, B), B)]),
    "cat legacy empty": (lambda x: torch.cat([EMPTY, x], dim=-2), (_r(4, 4, 6, 3),),
                         [((S0,), S0), ((S1,), S1), ((B,), B)]),
    "einsum attention": (lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k),
                         (_r(2, 4, 5, 3), _r(2, 4, 6, 3)),
                         [((S1, S1), S1), ((S2, B), S2), ((B, B), B)]),
    "einsum outer": (lambda t, f: torch.einsum("i,j->ij", t, f), (_r(8), _r(6)),
                     [((S0, B), S0), ((B, S0), S1)]),
    "einsum matmul": (lambda x, w: torch.einsum("bij,jk->bik", x, w), (_r(4, 3, 5), _r(5, 6)),
                      [((S0, B), S0), ((B, S1), S2)]),
    "gather": (lambda x, i: torch.gather(x, 1, i), (_r(8, 6), _idx(8, 3, 6)),
               [((S0, S0), S0), ((B, S1), S1), ((B, B), B)]),
    "scatter_add": (lambda x, i, s: x.scatter_add(1, i, s), (_r(8, 6), _idx(8, 3, 6),
                                                             _r(8, 3)),
                    [((S0, S0, S0), S0), ((B, B, B), B)]),
    "scatter": (lambda x, i, s: torch.scatter(x, 1, i, s), (_r(8, 6), _idx(8, 3, 6),
                                                            _r(8, 3)),
                [((S0, S0, S0), S0), ((B, B, B), B)]),
    "index_select": (lambda x, i: torch.index_select(x, 1, i),
                     (_r(8, 6), torch.tensor([4, 0, 4])),
                     [((S0, B), S0), ((B, S0), S1), ((B, B), B)]),
    "index_select plain index": (lambda x: x.index_select(0, torch.tensor([7, 1, 2, 1])),
                                 (_r(8, 6),), [((S1,), S1)]),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, dim=1), (_r(8, 6),),
                          [((S0,), S0), ((B,), B)]),
    "repeat_interleave split dim": (lambda x: torch.repeat_interleave(x, 3, 0), (_r(8, 6),),
                                    [((S0,), S0), ((S1,), S1)]),
    "flip": (lambda x: torch.flip(x, (1,)), (_r(8, 6, 4),), [((S0,), S0), ((S2,), S2)]),
    "flip method": (lambda x: x.flip(0, 2), (_r(8, 6, 4),), [((S1,), S1), ((B,), B)]),
    "roll": (lambda x: torch.roll(x, (2, -1), (1, 2)), (_r(8, 6, 4),), [((S0,), S0)]),
    "roll method": (lambda x: x.roll(3, 0), (_r(8, 6, 4),), [((S1,), S1), ((S2,), S2)]),
    "triu": (lambda x: torch.triu(x, 1), (_r(8, 6, 4),), [((S0,), S0), ((B,), B)]),
    "tril method": (lambda x: x.tril(-1), (_r(8, 6, 4),), [((S0,), S0)]),
    "logcumsumexp": (lambda x: torch.logcumsumexp(x, 2), (_r(8, 6, 4),),
                     [((S0,), S0), ((S1,), S1)]),
    "cummax": (lambda x: torch.cummax(x, 1).values, (_r(8, 6, 4),), [((S0,), S0), ((S2,), S2)]),
    "cummin indices": (lambda x: x.cummin(dim=0)[1], (_r(8, 6, 4),), [((S1,), S1)]),
    "sdpa gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True),
                 (_r(2, 8, 5, 4), _r(2, 4, 5, 4), _r(2, 4, 5, 4)),
                 [((S1, S1, S1), S1), ((S0, S0, S0), S0), ((B, B, B), B)]),
}


def _weights(fn, inputs):
    out = fn(*inputs)
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64) \
        if out.dtype.is_floating_point else None


def _run(cases):
    pl = sf.placement("cpu", [0, 1, 2, 3])
    got = {}
    for name, (fn, inputs, layouts, weight) in cases.items():
        for ins, _ in layouts:
            xs = [sf.tensor(t, pl, s) for t, s in zip(inputs, ins)]
            for x in xs:
                if x.dtype.is_floating_point:
                    x.requires_grad_()
            sf.comm.reset_stats()
            r = fn(*xs)
            fallback = sf.comm.stats()["fallback"].recv
            sbp, value = r.sbp, r.full_tensor()
            if weight is not None:
                (r * sf.tensor(weight, pl, B)).sum().backward()
            grads = [x.grad.full_tensor() if x.grad is not None else None for x in xs]
            got[name, ins] = (sbp, fallback, value, grads)
    return got


@pytest.fixture(scope="module")
def results():
    cases = {name: (fn, inputs, layouts, _weights(fn, inputs))
             for name, (fn, inputs, layouts) in CASES.items()}
    return sf.launch(_run, 4, args=(cases,))


@pytest.mark.parametrize("name", list(CASES))
def test_a_hot_function_equals_torch_and_keeps_its_layout_without_a_gather(name, results):
    fn, inputs, layouts = CASES[name]
    weight = _weights(fn, inputs)
    xs = [t.clone().requires_grad_() if t.dtype.is_floating_point else t for t in inputs]
    want = fn(*xs)
    if weight is not None:
        (want * weight).sum().backward()
    for ins, out in layouts:
        for rank, got in enumerate(results):
            sbp, fallback, value, grads = got[name, ins]
            assert fallback == 0, (name, ins, rank)
            assert sbp == (out,), (name, ins, sbp)
            assert value.dtype == want.dtype, (name, ins)
            torch.testing.assert_close(value, want.detach(), msg=f"{name} {ins}")
            for x, g in zip(xs, grads):
                if x.requires_grad:
                    torch.testing.assert_close(g, x.grad, msg=f"{name} {ins} grad")
