"""Search quality and speed of `sf.auto.search` (AutoDDL-style strategy search).

    .venv/bin/python benchmarks/auto_search.py           # ~19 minutes on 2 cores
    .venv/bin/python benchmarks/auto_search.py --quick   # a few minutes, smaller cases
    .venv/bin/python benchmarks/auto_search.py --targets # sections 5-6 only

(Most of the time is pricing edge-table entries: every entry is one analytic redistribution,
about 0.05-0.5 ms each, nested splits included: their point-to-point transfers are priced
from per-axis grid counts, up to 256 ranks.)

Sections (all costs are the analytic alpha-beta model on the dgx-a100 preset: 8 devices a node
on NVLink, 100 Gb/s between nodes, 80 GiB, compute at peak):

1. quality: the exact optimum (dynamic programming, "exhaustive") vs coordinate descent (cd,
   default restarts) vs Metropolis-Hastings and random search given the same wall time as cd
   took; cost relative to the optimum and wall time (search only; setup of the problem --
   per-layer candidate costs -- is included in "wall"); "edge entries": edge-cost table entries
   the search computed (the work: each is one analytic redistribution pricing).
2. enumeration vs cd on a tiny graph where plain enumeration of every combination finishes.
3. scale: GPT-3 (96 layers, d_model 12288, 96 heads, seq 2048, batch 1536) on 1024 devices
   (128 nodes): the exact optimum by DP vs one cd descent (default memory limit, 1 micro-batch),
   then cd with 16 micro-batches; wall time.
4. against experts: GPT configurations of the Megatron-LM paper (Narayanan et al. 2021,
   Table 1) on 64-256 devices: the found strategy's predicted communication time and bytes
   vs the best Megatron t x d under the same memory limit.
5. the issue's targets with default arguments (pipeline pass included): CPU and wall seconds
   and peak memory, each case in its own process.
6. pipeline choices at GPT-3 scale: the best pipeline of each stage count.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import sbpflow as sf  # noqa: E402
from sbpflow.auto import baselines, model_graphs, search  # noqa: E402
from sbpflow.auto.search_cli import FILL_BUDGET  # noqa: E402

GiB = 2 ** 30


def cluster(devices: int, per_node: int = 8):
    return sf.cost.Cluster.preset("dgx-a100", nodes=max(1, devices // per_node),
                                  devices_per_node=min(per_node, devices))


def timed(fn, *a, **k):
    t = time.perf_counter()
    r = fn(*a, **k)
    return r, time.perf_counter() - t


# ---- 1. quality ----------------------------------------------------------------------------------
def quality(cases, seed: int = 0, cd_long_s: float = 60.0):
    print("\n## 1. search quality: cost relative to the exact optimum; mh / random get the "
          "wall time cd took;\n   cd+: cd restarting from random points until 2x cd's time "
          f"(at most {cd_long_s:g} s; below cd's own time it may stop before cd's result)")
    hdr = (f"{'model':<18}{'devices':>8}{'algorithm':>12}{'time ms':>12}{'vs opt':>10}"
           f"{'wall s':>9}{'evals':>12}{'edge entries':>14}")
    print(hdr)
    print("-" * len(hdr))
    summary = []
    for name, g, p in cases:
        c = cluster(p)
        ex, t_ex = timed(search, g, c, "exhaustive", seed=seed)
        cd, t_cd = timed(search, g, c, "cd", seed=seed)
        eq = max(cd.seconds, 0.05)
        rows = [("exhaustive", ex, t_ex), ("cd", cd, t_cd)]
        for alg in ("mh", "random"):
            r, t = timed(search, g, c, alg, seed=seed, budget_s=eq, **FILL_BUDGET[alg])
            rows.append((alg, r, t))
        # cd with more random restarts: twice its default time (at most cd_long_s)
        long_s = min(2 * eq, cd_long_s)
        r, t = timed(search, g, c, "cd", seed=seed, budget_s=long_s, **FILL_BUDGET["cd"])
        rows.append(("cd+", r, t))
        opt = ex.cost
        for alg, r, t in rows:
            fits = "" if r.fits else "  (over memory)"
            rel = r.cost / opt
            print(f"{name:<18}{p:>8}{alg:>12}{r.cost * 1e3:>12.3f}"
                  f"{rel:>10.4f}{t:>9.2f}{r.evaluations:>12}{r.edge_evaluations:>14}{fits}")
            summary.append((name, alg, rel, t))
        print()
    by = {}
    for _, alg, rel, _ in summary:
        by.setdefault(alg, []).append(rel)
    print("geometric mean cost / optimum: " + ", ".join(
        f"{a} {math.exp(sum(map(math.log, v)) / len(v)):.4f}" for a, v in by.items()))
    for alg in ("cd", "cd+"):
        worst = max(r for _, a, r, _ in summary if a == alg)
        print(f"{alg} worst case: {(worst - 1) * 100:.2f} % above the optimum (goal <= 3 %)")
    walls = {}
    for _, alg, _, t in summary:
        walls.setdefault(alg, []).append(t)
    print("wall time per algorithm (s, summed over models): " +
          ", ".join(f"{a} {sum(v):.1f}" for a, v in walls.items()))


# ---- 2. enumeration vs cd ------------------------------------------------------------------------
def enumeration(sizes, p, seed: int = 0):
    g = model_graphs.mlp(sizes, batch=64)
    c = cluster(p)
    print(f"\n## 2. plain enumeration vs coordinate descent: mlp {sizes} on {p} devices")
    en, t_en = timed(search, g, c, "enumerate", seed=seed)
    ex, t_ex = timed(search, g, c, "exhaustive", seed=seed)
    cd, t_cd = timed(search, g, c, "cd", seed=seed)
    combos = en.evaluations
    hdr = f"{'algorithm':<12}{'time ms':>12}{'vs opt':>10}{'wall s':>10}{'evaluations':>14}"
    print(hdr)
    print("-" * len(hdr))
    for alg, r, t in (("enumerate", en, t_en), ("exhaustive", ex, t_ex), ("cd", cd, t_cd)):
        print(f"{alg:<12}{r.cost * 1e3:>12.4f}{r.cost / en.cost:>10.4f}{t:>10.3f}"
              f"{r.evaluations:>14}")
    print(f"{combos} combinations; enumeration / cd wall time: {t_en / t_cd:.0f}x")


# ---- 3. scale ------------------------------------------------------------------------------------
def scale(budget_s: float, seed: int = 0, exhaustive: bool = True):
    print("\n## 3. scale: GPT-3 (96 x 12288, 96 heads, seq 2048, batch 1536) on 1024 devices")
    g = model_graphs.gpt(96, 12288, 96, 2048, 1536)
    c = cluster(1024)
    print(f"{len(g.layers)} layers, {g.params / 1e9:.1f} B params")
    if exhaustive:
        # the call: default memory limit (80 GiB), 1 micro-batch. Nothing fits, so
        # the objective is the penalised one and one DP pass at the penalty price is exact.
        ex, t_ex = timed(search, g, c, "exhaustive", seed=seed)
        cd, t_cd = timed(search, g, c, "cd", seed=seed, restarts=0)
        print(f"{'algorithm':<22}{'objective':>14}{'vs opt':>12}{'wall s':>9}{'edge entries':>14}"
              f"{'GiB/device':>12}")
        for alg, r, t in (("exhaustive (DP)", ex, t_ex), ("cd, one descent", cd, t_cd)):
            print(f"{alg:<22}{r.cost:>14.4f}{r.cost / ex.cost:>12.6f}{t:>9.1f}"
                  f"{r.edge_evaluations:>14}{r.breakdown.memory['total'] / GiB:>12.1f}"
                  + ("" if r.fits else "  (over memory: penalised objective)"))
    print("cd (one descent from data parallel), 16 micro-batches, 80 GiB limit:")
    # one descent from data parallel (restarts=0): the time to a local optimum
    r, t = timed(search, g, c, "cd", seed=seed, budget_s=budget_s, micro_batches=16,
                 restarts=0)
    meg = baselines.best_megatron(g, c, c.memory_per_device)
    dp = sf.auto.evaluate(g, baselines.data_parallel(g, c), c)
    print(f"cd: wall {t:.1f} s (search {r.seconds:.1f} s, budget {budget_s:g} s), "
          f"{r.evaluations} evaluations, "
          f"micro-batches {r.micro_batches}, predicted step {r.breakdown.time * 1e3:.1f} ms, "
          f"memory {r.breakdown.memory['total'] / GiB:.1f} GiB/device, fits: {r.fits}")
    tr = r.trace
    print("best cost over time (s, ms): " + ", ".join(f"({a:.1f}, {b * 1e3:.1f})" for a, b in tr))
    if tr:
        final = tr[-1][1]
        t1 = next(a for a, b in tr if b <= final * 1.01)
        print(f"within 1 % of its final cost after {t1:.1f} s; "
              f"{'stopped by the budget' if r.seconds >= budget_s else 'converged'}")
    print(f"data parallel: {dp.time * 1e3:.1f} ms, {dp.memory['total'] / GiB:.1f} GiB/device")
    if meg is None:
        print("no Megatron t x d fits 80 GiB/device (no pipeline / ZeRO in the baseline)")
    else:
        print(f"best Megatron tp {meg[2]}: {meg[1].time * 1e3:.1f} ms")
    return t


# ---- 4. against experts --------------------------------------------------------------------------
# Megatron-LM (Narayanan et al., SC'21) Table 1: (params, heads, hidden, layers, gpus, batch)
MEGATRON_CONFIGS = [
    ("3.6B", 32, 3072, 30, 64, 512),
    ("7.5B", 32, 4096, 36, 128, 512),
    ("18.4B", 48, 6144, 40, 256, 1024),
]


def best_megatron_micro(g, c, limit):
    """The best Megatron t x d that fits ``limit`` with the fewest micro-batches (gradient
    accumulation, 1, 2, 4, ...): (micro_batches, strategy, breakdown, tp) or None."""
    m, batch = 1, g.layers[-1].input_shape[0]
    while m <= batch:
        best = None
        for tp in (t for t in range(1, c.world_size + 1) if c.world_size % t == 0):
            try:
                s = baselines.megatron(g, c, tp)
            except ValueError:
                continue
            b = sf.auto.evaluate(g, s, c, m)
            if b.memory["total"] <= limit and (best is None or b.time < best[2].time):
                best = (m, s, b, tp)
        if best is not None:
            return best
        m *= 2
    return None


def experts(configs, budget_s: float, seq: int = 2048, seed: int = 0):
    print(f"\n## 4. against experts: Megatron-LM paper GPTs (seq {seq}), cd budget {budget_s:g} s; "
          "same memory limit (80 GiB/device) and micro-batches for both")
    hdr = (f"{'model':<8}{'devices':>8}{'micro':>6}{'best Megatron':>15}{'Meg comm ms':>13}"
           f"{'found comm ms':>15}{'comm ratio':>12}{'Meg GB/dev':>11}{'found GB/dev':>13}"
           f"{'step ratio':>12}{'wall s':>8}")
    print(hdr)
    print("-" * len(hdr))
    for name, heads, d, layers, p, batch in configs:
        g = model_graphs.gpt(layers, d, heads, seq, batch)
        c = cluster(p)
        meg = best_megatron_micro(g, c, c.memory_per_device)
        if meg is None:
            print(f"{name:<8}{p:>8}{'':>6}{'none fits':>15}")
            continue
        m, s, mb, tp = meg
        r, t = timed(search, g, c, "cd", seed=seed, budget_s=budget_s, micro_batches=m,
                     start=s)
        fb = r.breakdown
        print(f"{name:<8}{p:>8}{m:>6}{f'tp{tp} x dp{p // tp}':>15}{mb.comm_time * 1e3:>13.1f}"
              f"{fb.comm_time * 1e3:>15.1f}{fb.comm_time / mb.comm_time:>12.3f}"
              f"{mb.bytes / 1e9:>11.2f}{fb.bytes / 1e9:>13.2f}{fb.time / mb.time:>12.3f}"
              f"{t:>8.1f}" + ("" if r.fits else "  (over memory)"))
    print("comm ratio = found / best Megatron predicted communication time (< 1: found is "
          "better); GB/dev: bytes each device sends per step; step ratio includes compute; "
          "cd starts from the best Megatron")


# ---- 5. targets of issue 17 (default arguments, pipeline pass included) ---------------------------
TARGETS = {
    # name: (what, target seconds)
    "gpt3-cd": ("GPT-3 on dgx-a100 x 128 nodes, cd", 10.0),
    "gpt3-exhaustive": ("GPT-3 on dgx-a100 x 128 nodes, exhaustive", 30.0),
    "vgg13-64": ("VGG-13 (batch 512), 64 single-GPU nodes, no flops", 5.0),
}


def _target_case(name: str):
    """``(graph, cluster, algorithm)`` of a target: default arguments of `sf.auto.search`."""
    if name.startswith("gpt3"):
        g = model_graphs.gpt(96, 12288, 96, 2048, 1536, 51200)
        return g, sf.cost.Cluster.preset("dgx-a100", nodes=128), name.split("-")[1]
    return (model_graphs.vgg13(512),
            sf.cost.Cluster.preset("supercomputer", nodes=64, flops_per_device=None), "cd")


def run_target(name: str) -> None:
    """One target in this process (``--target``): one line of figures, peak RSS included."""
    import resource
    g, c, alg = _target_case(name)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cpu, wall = time.process_time(), time.perf_counter()
    r = sf.auto.search(g, c, alg)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    pp = r.strategy.pipeline
    where = "one stage" if pp is None else \
        f"{pp.stages} stages x {pp.devices} dev, M {pp.micro_batches} {pp.schedule}"
    print(f"RESULT {name} {cpu:.2f} {wall:.2f} {rss:.0f} {rss0:.0f} {r.cost:.6g} {int(r.fits)} "
          f"{where}")


def targets(names) -> None:
    """Each target in a child process (its own peak memory), one row each."""
    import subprocess
    print("\n## 5. issue 17 targets: default arguments (pipeline pass included), each in its "
          "own process;\n   cpu = process CPU seconds (wall is inflated on a loaded machine), "
          "peak RSS of the process (before the search: imports, torch)")
    hdr = (f"{'case':<46}{'cpu s':>8}{'wall s':>8}{'target s':>9}{'peak MB':>9}{'base MB':>9}"
           f"{'step s':>9}{'fits':>6}  choice")
    print(hdr)
    print("-" * len(hdr))
    for name in names:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--target", name],
                             capture_output=True, text=True)
        line = next((l for l in out.stdout.split("\n") if l.startswith("RESULT")), None)
        if line is None:
            print(f"{TARGETS[name][0]:<46} failed: {out.stderr.strip()[-300:]}")
            continue
        _, _, cpu, wall, rss, rss0, cost, fits, *where = line.split()
        print(f"{TARGETS[name][0]:<46}{float(cpu):>8.1f}{float(wall):>8.1f}"
              f"{TARGETS[name][1]:>9g}{float(rss):>9.0f}{float(rss0):>9.0f}{float(cost):>9.3f}"
              f"{'yes' if fits == '1' else 'NO':>6}  {' '.join(where)}")


def pipeline_choices(counts=(2, 4, 8, 16, 32)) -> None:
    """GPT-3 on 1024 devices: the best pipeline found for each stage count (``stages=S``)."""
    print("\n## 6. pipeline choices at GPT-3 scale (dgx-a100 x 128, 80 GiB, cd): the best "
          "pipeline of each stage count")
    g, c, _ = _target_case("gpt3-cd")
    hdr = (f"{'stages':>7}{'devices':>8}{'micro':>7}{'step s':>9}{'bubble s':>10}"
           f"{'max GiB':>9}{'fits':>6}{'cpu s':>8}")
    print(hdr)
    print("-" * len(hdr))
    for s in counts:
        cpu = time.process_time()
        r = sf.auto.search(g, c, "cd", stages=s)
        cpu = time.process_time() - cpu
        b, pp = r.breakdown, r.strategy.pipeline
        print(f"{s:>7}{pp.devices:>8}{pp.micro_batches:>7}{b.time:>9.3f}{b.bubble_time:>10.3f}"
              f"{max(b.stage_memory) / GiB:>9.1f}{'yes' if r.fits else 'NO':>6}{cpu:>8.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller cases (~1 minute)")
    ap.add_argument("--targets", action="store_true",
                    help="only section 5 (the issue's targets) and 6 (pipeline choices)")
    ap.add_argument("--target", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.target:
        run_target(args.target)
        return 0
    t0 = time.perf_counter()
    if args.targets:
        targets(list(TARGETS))
        pipeline_choices()
        print(f"\ntotal {time.perf_counter() - t0:.0f} s")
        return 0
    print(f"sbpflow auto search benchmark ({'quick' if args.quick else 'full'}), "
          f"torch {__import__('torch').__version__}, {os.cpu_count()} cpu(s)")
    if args.quick:
        cases = [("gpt-2x512", model_graphs.gpt(2, 512, 8, 512, 32), 16),
                 ("dlrm", model_graphs.dlrm(2048, tables=8), 16)]
        quality(cases, args.seed, cd_long_s=10.0)
        enumeration((512, 1024, 1024, 512), 4, args.seed)
        scale(10.0, args.seed)
        experts(MEGATRON_CONFIGS[:1], 5.0, seed=args.seed)
    else:
        cases = [("alexnet", model_graphs.alexnet(128), 16),
                 ("vgg13", model_graphs.vgg13(64), 16),
                 ("dlrm", model_graphs.dlrm(2048), 32),
                 ("gpt-12x1024", model_graphs.gpt(12, 1024, 16, 1024, 64), 64)]
        quality(cases, args.seed)
        enumeration((512, 1024, 1024, 512), 8, args.seed)
        scale(60.0, args.seed)
        experts(MEGATRON_CONFIGS, 20.0, seed=args.seed)
        targets(list(TARGETS))
        pipeline_choices()
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
