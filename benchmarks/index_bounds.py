"""Cost of the index range checks (issue 12): per-call time of the ops whose kernels check ids
or targets, on one rank (a 1-rank placement still takes the vocab-split / class-split kernels:
its table is laid out S(0), its logits S(1)), so the figure is the kernel's own cost without
thread noise; CPU time of the calling thread, best of 5 rounds. Run before and after a change
and compare:

    .venv/bin/python benchmarks/index_bounds.py [--repeat 200] [--only embedding] [--dim 64]

``--ab`` times each call with the check switched off and on, alternated in one process.

On a shared machine, MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 in the
environment keeps glibc from mapping fresh pages for every large tensor (the cross-entropy
figures are otherwise bimodal).
"""

from __future__ import annotations

import argparse
import time
import timeit

import torch

import sbpflow as sf
import sbpflow.nn.functional as SF


def _cases(pl, dim: int = 64) -> dict:
    """name -> a no-argument callable running one forward call (``dim``: embedding width)."""
    g = torch.Generator().manual_seed(0)
    vocab, rows, classes = 8192, 4096, 1000
    n_ce = 512  # cross-entropy rows (the logits are n_ce x classes)
    ids = sf.tensor(torch.randint(0, vocab, (8, rows // 8), generator=g), pl, sf.B)
    table_v = sf.tensor(torch.randn(vocab, dim, generator=g), pl, sf.S(0))
    table_p = sf.nn.Parameter(table_v)
    table_b = sf.tensor(torch.randn(vocab, dim, generator=g), pl, sf.B)
    logits = torch.randn(n_ce, classes, generator=g)
    target = sf.tensor(torch.randint(0, classes, (n_ce,), generator=g), pl, sf.B)
    lg_c = sf.tensor(logits, pl, sf.S(1))
    lg_b = sf.tensor(logits, pl, sf.B)
    w = sf.tensor(torch.rand(classes, generator=g), pl, sf.B)
    return {
        "embedding, vocab-split table": lambda: SF.embedding(ids, table_v),
        "embedding, vocab-split parameter": lambda: SF.embedding(ids, table_p),
        "embedding, replicated table": lambda: SF.embedding(ids, table_b),
        "cross_entropy, class-split logits": lambda: SF.cross_entropy(lg_c, target).item(),
        "cross_entropy, B logits, fused": lambda: SF.cross_entropy(lg_b, target).item(),
        "cross_entropy, B logits, class weights": lambda: SF.cross_entropy(lg_b, target,
                                                                           weight=w).item(),
    }


def _best(call, repeat: int) -> float:
    """Seconds a call: CPU time of this thread (torch runs on it alone, so other processes on
    a loaded machine do not count, as they would in wall time), best of 5 rounds."""
    n = max(repeat // 5, 1)
    return min(timeit.repeat(call, number=n, repeat=5, timer=time.thread_time)) / n


def _ab(cases: dict, repeat: int, rounds: int = 6) -> None:
    """The same calls with the range check a no-op and real, alternated in this process (the
    check's own cost, free of the heap and cache state of two separate runs)."""
    from sbpflow.ops import nn_ops
    real = nn_ops.check_index_range
    best: dict = {}
    try:
        for _ in range(rounds):
            for label, fn in (("off", lambda *a, **k: None), ("on", real)):
                nn_ops.check_index_range = SF.check_index_range = fn
                for name, call in cases.items():
                    call()
                    t = _best(call, repeat)
                    best[name, label] = min(best.get((name, label), t), t)
    finally:
        nn_ops.check_index_range = SF.check_index_range = real
    for name in cases:
        off, on = best[name, "off"], best[name, "on"]
        print(f"{name:42s} {off * 1e6:9.1f} us -> {on * 1e6:9.1f} us ({(on - off) / off:+.1%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--dim", type=int, default=64, help="embedding width")
    ap.add_argument("--ab", action="store_true",
                    help="time each call without and with the range check, alternated")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pl = sf.placement("cpu", ranks=[0])
    cases = {k: v for k, v in _cases(pl, args.dim).items() if args.only in k}
    if args.ab:
        _ab(cases, args.repeat)
        return
    for name, call in cases.items():
        call()  # warm the dispatch caches
        print(f"{name:42s} {_best(call, args.repeat) * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
