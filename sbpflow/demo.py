"""`sbpflow demo`: boxing plans shown, then run on simulated ranks with bytes counted.

Each row plans a redistribution, runs it on 4 in-process ranks, checks the logical value is
unchanged, and compares the bytes the communicator counted with the plan's cost.
"""

from __future__ import annotations

import math

import torch

from . import comm as _comm
from .placement import placement
from .sbp import B, P, S, format_nd_sbp
from .tensor import from_local, randn
from .boxing import plan

LINE = placement("cpu", [0, 1, 2, 3])
MESH = placement("cpu", [[0, 1], [2, 3]])
PAIR_A, PAIR_B = placement("cpu", [0, 1]), placement("cpu", [2, 3])

CASES = [
    ("split to split (all-to-all)", LINE, (S(0),), LINE, (S(1),)),
    ("split to broadcast (all-gather)", LINE, (S(0),), LINE, (B,)),
    ("partial to broadcast (all-reduce)", LINE, (P,), LINE, (B,)),
    ("partial to split (reduce-scatter)", LINE, (P,), LINE, (S(0),)),
    ("broadcast to partial (free)", LINE, (B,), LINE, (P,)),
    ("2x2: (S0,S1) -> (B,S0)", MESH, (S(0), S(1)), MESH, (B, S(0))),
    ("2x2: (P,P) -> (B,B), one all-reduce", MESH, (P, P), MESH, (B, B)),
    ("2x2: (S0,S1) -> (S1,S0), shards only", MESH, (S(0), S(1)), MESH, (S(1), S(0))),
    ("2x2: (S0,S0) -> (B,S0)", MESH, (S(0), S(0)), MESH, (B, S(0))),
    ("pipeline hop: [0,1] P -> [2,3] B", PAIR_A, (P,), PAIR_B, (B,)),
    ("1-D to 2-D: S0 -> (S0,S1)", LINE, (S(0),), MESH, (S(0), S(1))),
]

SHAPE = (1024, 768)


def _run_case(src_pl, src, dst_pl, dst):
    x = randn(*SHAPE, placement=src_pl, sbp=tuple(B if s == P else s for s in src), seed=0)
    if P in src:
        # a genuinely partial tensor: the ranks of the P dims each hold an equal part
        n = math.prod(m for s, m in zip(src, src_pl.shape) if s == P)
        x = from_local(x.local / n, src_pl, src, shape=SHAPE)
    ref = x.full_tensor()
    _comm.reset_stats()
    y = x.to_global(dst_pl, dst)
    counted = _comm.stats().sent
    ok = torch.allclose(y.full_tensor(), ref, atol=1e-5)
    return counted, ok


def main() -> None:
    print(f"sbpflow demo: boxing a {SHAPE[0]}x{SHAPE[1]} float32 tensor "
          f"({SHAPE[0] * SHAPE[1] * 4 / 2**20:.1f} MiB) on 4 simulated ranks (threads backend)\n")
    results = {}
    for i, (_, spl, s, dpl, d) in enumerate(CASES):
        per_rank = _comm.launch(_run_case, 4, args=(spl, s, dpl, d))
        results[i] = (sum(c for c, _ in per_rank), all(ok for _, ok in per_rank))
    rows = []
    for i, (title, spl, s, dpl, d) in enumerate(CASES):
        p = plan(SHAPE, torch.float32, (spl, s), (dpl, d))
        counted, ok = results[i]
        print(f"== {title}")
        print(p)
        print(f"   ran on 4 ranks: value {'unchanged' if ok else 'CHANGED'}, "
              f"bytes counted {counted} {'==' if counted == p.nbytes else '!='} planned {p.nbytes}\n")
        rows.append((title, f"{spl} {format_nd_sbp(s)}", f"{dpl} {format_nd_sbp(d)}",
                     " + ".join(st.kind for st in p.steps) or "-", p.nbytes, counted, ok))
    print(f"{'transition':<40} {'steps':<34} {'planned MiB':>11} {'counted MiB':>11}  value")
    for title, _, _, steps, planned, counted, ok in rows:
        print(f"{title:<40} {steps:<34} {planned / 2**20:>11.2f} {counted / 2**20:>11.2f}  "
              f"{'ok' if ok else 'WRONG'}")
    if not all(r[-1] and r[4] == r[5] for r in rows):
        raise SystemExit("demo: a boxing changed the value or moved unplanned bytes")


if __name__ == "__main__":
    main()
