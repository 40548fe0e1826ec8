"""The Megatron-LM paper's Table 1 against the cost model and the search (issue 17, part 5).

    .venv/bin/python benchmarks/auto_megatron.py                 # every row; search up to 175B
    .venv/bin/python benchmarks/auto_megatron.py --rows 0 6      # some rows (indices)
    .venv/bin/python benchmarks/auto_megatron.py --no-search     # the prediction alone, < 1 s
    .venv/bin/python benchmarks/auto_megatron.py --rows 0 1 2 3 4 5 6 --grid  # ~2 min

Per row of Table 1 (Narayanan et al., SC'21; `sbpflow.auto.baselines.TABLE1`): Megatron's own
configuration (tensor x pipeline x data, one sequence a micro-batch, full activation
recomputation of every transformer block as the paper's runs had) evaluated on the dgx-a100
preset, its predicted TFLOP/s a GPU (the paper's FLOP count over the predicted step time) next
to the paper's measured figure (the PyTorch-based Megatron-LM on A100s: the reference this
benchmark compares with; nothing is run), then `sf.auto.search` with default arguments and the
same 80 GiB memory limit, one row at a time: the strategy found, its predicted step time over
Megatron's (``/ no-rc``: over Megatron's configuration without recomputation, which the paper
did not run but which fits 80 GiB on rows 0-8), and the search's wall time on this machine.
Rows above ``--search-up-to`` billion parameters are evaluated only. ``--no-recompute``:
Megatron's configurations (the rows and the grid) without recomputation. ``--grid``: under each row, the best Megatron configuration of
a grid of tp x pp x dp x micro-batches in the same cost model and memory limit (is the paper's
within 5 % of Megatron's best, and does the search beat that?), and where Megatron's step
goes beyond the compute floor (the work spread evenly: no strategy is faster).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import sbpflow as sf  # noqa: E402
from sbpflow.auto import Strategy, evaluate  # noqa: E402
from sbpflow.auto.baselines import TABLE1, megatron, table1_case  # noqa: E402

GiB = 2 ** 30


def describe(result) -> str:
    """Stages x devices, micro-batches and the most common layout of the linears found."""
    s = result.strategy
    labels = collections.Counter(st.label for l, st in zip(s.graph.layers, s.layers)
                                 if l.kind == "linear")
    common = labels.most_common(1)[0][0] if labels else "-"
    pp = s.pipeline
    stages = f"pp {pp.stages}x{pp.devices}" if pp else "pp 1"
    return f"{stages}, m {result.micro_batches}, {common} (+{len(labels) - 1} more)"


def _sequence_splits(strategy) -> list:
    """Per attention layer, (its batch in sequences, the ways its sequences are split)."""
    out = []
    for layer, st in zip(strategy.graph.layers, strategy.layers):
        if layer.kind == "attention":
            f = math.prod(size for x, size in zip(st.input, st.mesh)
                          if isinstance(x, sf.sbp.Split) and x.axis == 0)
            out.append((layer.attrs["batch"], f))
    return out


def whole_sequences(strategy, micro_batches: int) -> int:
    """The most micro-batches, at most ``micro_batches``, whose every micro-batch still holds
    whole sequences on each device the attention splits them over (the space checks the split
    against the whole batch, not a micro-batch's: docs/auto.md, 'Against Megatron-LM')."""
    splits = _sequence_splits(strategy)
    for m in range(micro_batches, 0, -1):
        if all(b % m == 0 and (b // m) % f == 0 for b, f in splits):
            return m
    return 1


def with_micro_batches(graph, cluster, result, m: int):
    """The found strategy run with ``m`` micro-batches instead: (strategy, breakdown)."""
    s = result.strategy
    if s.pipeline is None:
        return s, evaluate(graph, s, cluster, m)
    s = Strategy(graph, s.layers, s.pipeline._replace(micro_batches=m))
    return s, evaluate(graph, s, cluster)


def megatron_grid(case, row, limit: float = 80 * GiB, recompute: bool = True):
    """The best Megatron configuration in the cost model under ``limit``: tensor tp in 1, 2,
    4, 8 x pipeline pp dividing the layers x data the rest, micro-batches M dividing the
    batch with whole sequences on each data-parallel rank (M >= pp when pp > 1; with pp 1,
    M is gradient accumulation). Returns (step s, tp, pp, dp, M) or None."""
    g, c, p, best = case.graph, case.cluster, case.cluster.world_size, None
    for tp in (1, 2, 4, 8):
        for pp in (k for k in range(1, row.layers + 1) if row.layers % k == 0):
            if p % (tp * pp) or row.heads % tp:
                continue
            dp = p // (tp * pp)
            for m in range(pp, row.batch + 1):
                if row.batch % m or (row.batch // m) % dp:
                    continue
                try:
                    s = megatron(g, c, tp, pp, dp, m, recompute=recompute)
                except ValueError:
                    continue
                b = evaluate(g, s, c, m if pp == 1 else 1)
                mem = max(b.stage_memory) if pp > 1 else b.memory["total"]
                if mem <= limit and (best is None or b.time < best[0]):
                    best = (b.time, tp, pp, dp, m)
    return best


def compute_floor(case) -> float:
    """The step time of the row's work (forward + backward flops of every layer) spread evenly
    over every device at the preset's speed: no strategy in the cost model is faster."""
    return _spread(case, 3 * sum(l.flops for l in case.graph.layers))


def _spread(case, work: float) -> float:
    """Seconds of ``work`` flops spread evenly over every device at the preset's speed."""
    c = case.cluster
    return work / (c.flops_per_device * c.compute_efficiency) / c.world_size


def recompute_time(case) -> float:
    """The recomputed forward of the layers Megatron's configuration recomputes, spread evenly
    over every device at the preset's speed (0 without recomputation)."""
    return _spread(case, sum(l.flops for l, s in zip(case.graph.layers, case.strategy.layers)
                             if s.recompute))


def parts_line(case) -> str:
    """Where Megatron's predicted step time goes beyond the compute floor: the recomputed
    forward, and per stage (stages alike, so the sums over stages / S) its tensor-parallel
    collectives and gradient sync, the bubble, and the rest (the slowest stage's excess,
    stage-to-stage transfers)."""
    b, floor, rc = case.breakdown, compute_floor(case), recompute_time(case)
    s = max(b.stages, 1)
    tp, gs = (b.forward_time + b.backward_time) / s, b.grad_sync_time / s
    rest = b.time - floor - rc - tp - gs - b.bubble_time
    return (f"      Megatron's step: compute floor {floor:.2f} s ({b.time / floor:.3f}x it), "
            f"recompute {rc:.2f}, tp collectives {tp:.2f}, grad sync {gs:.2f}, bubble "
            f"{b.bubble_time:.2f}, rest {rest:.2f}; 0.95x is {0.95 * b.time:.2f} s")


def grid_line(case, row, recompute: bool) -> str:
    best = megatron_grid(case, row, recompute=recompute)
    if best is None:
        return "      best Megatron config in the model: none fits"
    t, tp, pp, dp, m = best
    return (f"      best Megatron config in the model: t{tp} p{pp} d{dp} m{m}, step {t:.2f} s, "
            f"{t / case.breakdown.time:.3f}x the paper's")


def row_line(i: int, row, search: bool, budget, recompute: bool) -> str:
    case = table1_case(row, recompute=recompute)
    b = case.breakdown
    cfg = f"t{row.tp} p{row.pp} d{row.dp} m{case.micro_batches}"
    mem = b.memory["total"] / GiB
    head = (f"{i:>3} {row.params_b:>7.1f}B {row.gpus:>5} {cfg:<20}{row.tflops:>7.0f}"
            f"{case.tflops:>8.1f}{case.tflops / row.tflops:>7.2f}{b.time:>9.2f}{mem:>7.1f}")
    if not search:
        return head + "   (not searched)"
    t0 = time.perf_counter()
    r = sf.auto.search(case.graph, case.cluster, memory_limit=80 * GiB, budget_s=budget)
    wall = time.perf_counter() - t0
    fits = "" if r.fits else " DOES NOT FIT"
    m = whole_sequences(r.strategy, r.micro_batches)
    _, vb = with_micro_batches(case.graph, case.cluster, r, m)
    vfits = "" if vb.memory["total"] <= 80 * GiB else " DOES NOT FIT"
    plain = table1_case(row, recompute=False).breakdown.time
    return (head + f"  {describe(r):<44}{r.breakdown.time:>9.2f}"
            f"{r.breakdown.time / b.time:>7.3f}{m:>6}{vb.time / b.time:>7.3f}{vfits}"
            f"{r.breakdown.time / plain:>8.3f}{wall:>8.0f}{fits}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", help="row indices (default: all)")
    ap.add_argument("--no-search", action="store_true", help="only evaluate Megatron's configs")
    ap.add_argument("--search-up-to", type=float, default=175.0,
                    help="search rows up to this many billion parameters (default 175)")
    ap.add_argument("--grid", action="store_true",
                    help="also the best Megatron tp x pp x dp x M in the cost model, a row")
    ap.add_argument("--no-recompute", action="store_true",
                    help="Megatron's configurations without activation recomputation")
    ap.add_argument("--budget", type=float, default=None,
                    help="search budget_s a row (default: none, the search's default)")
    a = ap.parse_args(argv)
    c = sf.cost.Cluster.preset("dgx-a100")
    print(f"dgx-a100 preset: {c.flops_per_device / 1e12:.0f} TFLOP/s peak x compute efficiency "
          f"{c.compute_efficiency}, NVLink {1 / c.intra.beta / 1e9:.0f} GB/s, "
          f"{1 / c.inter.beta / 1e9:.1f} GB/s between nodes a device, "
          f"{c.memory_per_device / GiB:.0f} GiB")
    rc = not a.no_recompute
    print(f"Megatron's configurations {'with full' if rc else 'without'} activation "
          "recomputation")
    print(f"{'row':>3} {'params':>8} {'GPUs':>5} {'Megatron config':<20}{'paper':>7}{'pred':>8}"
          f"{'ratio':>7}{'step s':>9}{'GiB':>7}  {'found (search, default arguments)':<44}"
          f"{'step s':>9}{'/ Meg':>7}{'m ok':>6}{'/ Meg':>7}{'/ no-rc':>8}{'wall s':>8}")
    for i in (a.rows if a.rows else range(len(TABLE1))):
        row = TABLE1[i]
        search = not a.no_search and row.params_b <= a.search_up_to
        print(row_line(i, row, search, a.budget, rc), flush=True)
        if a.grid:
            case = table1_case(row, recompute=rc)
            print(parts_line(case), flush=True)
            print(grid_line(case, row, rc), flush=True)


if __name__ == "__main__":
    main()
