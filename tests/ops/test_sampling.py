"""``torch.multinomial`` on global tensors (sbpflow/ops/sampling.py) against its formula in plain
torch: draw k after ``sf.manual_seed(s)`` is seeded ``s_k = mix_seed(s, k)``, and row r of it is
``torch.multinomial(probs[r], n, replacement, generator=torch.Generator().manual_seed(
mix_seed(s_k, r)))``; the same tokens in every layout, the rows kept split, nothing gathered;
with a torch generator, torch's draw on the whole value."""

import torch

import sbpflow as sf
from sbpflow.random_regions import mix_seed

PROBS = torch.softmax(torch.randn(6, 10, dtype=torch.float64,
                                  generator=torch.Generator().manual_seed(0)), -1)


def _by_rows(probs, step: int, n: int, replacement: bool) -> torch.Tensor:
    rows = probs.reshape(-1, probs.shape[-1])
    return torch.stack([torch.multinomial(row, n, replacement, generator=torch.Generator()
                                          .manual_seed(mix_seed(step, r)))
                        for r, row in enumerate(rows)]).reshape(*probs.shape[:-1], n)


def _draws(p):
    return (torch.multinomial(p, 1), p.multinomial(4, replacement=True),
            torch.multinomial(p[2], 3))


def test_multinomial_is_its_formula_in_every_layout():
    def body():
        pl = sf.placement("cpu", [0, 1, 2, 3])
        out = []
        for sbp in (sf.S(0), sf.S(1), sf.B):
            sf.manual_seed(5)
            sf.comm.reset_stats()
            draws = _draws(sf.tensor(PROBS, pl, sbp))
            moved = sf.comm.stats()
            out.append(([d.full_tensor() for d in draws], draws[0].sbp, moved))
        g = torch.Generator().manual_seed(3)
        mine = torch.multinomial(sf.tensor(PROBS, pl, sf.S(0)), 2, generator=g).full_tensor()
        return out, mine
    results, with_generator = sf.launch(body, world_size=4)[0]
    want = (_by_rows(PROBS, mix_seed(5, 0), 1, False), _by_rows(PROBS, mix_seed(5, 1), 4, True),
            _by_rows(PROBS[2], mix_seed(5, 2), 3, False))
    for (got, sbp, moved), layout in zip(results, ("S0", "S1", "B")):
        assert all(torch.equal(g, w) for g, w in zip(got, want)), layout
        assert sbp == ((sf.S(0),) if layout != "B" else (sf.B,)), (layout, sbp)
        if layout == "S0":
            assert "fallback" not in str(moved), moved
    assert torch.equal(with_generator,
                       torch.multinomial(PROBS, 2, generator=torch.Generator().manual_seed(3)))
