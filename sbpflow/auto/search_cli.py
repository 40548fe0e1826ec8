"""``sbpflow search``: find a parallel strategy for a preset model on a modelled cluster.

    sbpflow search --model gpt --layers 24 --d-model 1024 --heads 16 --seq 1024 --batch 512 \\
        --nodes 2 --devices-per-node 8 --cluster dgx-a100 [--algorithm cd] [--plot out.png]

Prints the found strategy's pipeline (stages, micro-batches, schedule; ``--stages``), its
per-layer table (stage, mesh, layouts, predicted time, bytes per device) and breakdown, the
same summary for data parallel and the best Megatron t x d that fits memory, and a
comparison. ``--plot`` also runs every algorithm (cd, mh, random for
``--budget-s`` each; the exact DP once) and saves the best cost over time as a PNG.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time

from ..errors import SbpError, SearchCliError

__all__ = ["SearchCliError", "add_arguments", "search_command", "build_graph", "build_cluster",
           "run_search", "run_command", "plot_convergence", "pipeline_line", "MODELS",
           "FILL_BUDGET"]

GiB = 2 ** 30
MODELS = ("gpt", "vgg13", "alexnet", "dlrm", "mlp")
# batch default per model (None in argparse so we can tell "not given")
_DEFAULT_BATCH = {"gpt": 8, "vgg13": 64, "alexnet": 128, "dlrm": 2048, "mlp": 64}


def _positive(name, v):
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SearchCliError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")


def add_arguments(parser) -> None:
    """Arguments of ``sbpflow search`` on an argparse parser."""
    m = parser.add_argument_group("model")
    m.add_argument("--model", default="gpt",
                   help=f"preset model: {', '.join(MODELS)} (default gpt)")
    m.add_argument("--batch", type=int, default=None,
                   help="global batch (sequences for gpt; default per model: "
                        + ", ".join(f"{k} {v}" for k, v in _DEFAULT_BATCH.items()) + ")")
    m.add_argument("--layers", type=int, default=12, help="gpt: transformer blocks (default 12)")
    m.add_argument("--d-model", type=int, default=768, help="gpt: hidden size (default 768)")
    m.add_argument("--heads", type=int, default=12, help="gpt: attention heads (default 12)")
    m.add_argument("--seq", type=int, default=1024, help="gpt: sequence length (default 1024)")
    m.add_argument("--vocab", type=int, default=50257, help="gpt: vocabulary (default 50257)")
    m.add_argument("--num-classes", type=int, default=1000,
                   help="vgg13 / alexnet: classes (default 1000)")
    m.add_argument("--tables", type=int, default=26, help="dlrm: embedding tables (default 26)")
    m.add_argument("--rows", type=int, default=1_000_000,
                   help="dlrm: rows a table (default 1000000)")
    m.add_argument("--dim", type=int, default=128, help="dlrm: embedding dim (default 128)")
    m.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=None,
                   help="mlp: layer widths, comma-separated (default 1024,4096,1024)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--cluster", default="dgx-a100",
                   help="cluster preset (dgx-a100, supercomputer / piz-daint; default dgx-a100)")
    c.add_argument("--cluster-file", default=None,
                   help="cluster JSON (e.g. from `sbpflow calibrate`); --nodes / "
                        "--devices-per-node override its topology")
    c.add_argument("--nodes", type=int, default=None, help="nodes (default 1, or the file's)")
    c.add_argument("--devices-per-node", type=int, default=None,
                   help="devices a node (default: the preset's or the file's)")
    c.add_argument("--memory-limit", type=float, default=None,
                   help="memory per device in GiB (default: the cluster's)")
    s = parser.add_argument_group("search")
    s.add_argument("--algorithm", choices=["cd", "mh", "random", "exhaustive"], default="cd",
                   help="cd: coordinate descent with restarts (default); mh: Metropolis-"
                        "Hastings; random; exhaustive: exact optimum (dynamic programming)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--budget-s", type=float, default=30.0,
                   help="wall-clock budget of the search in seconds (default 30)")
    s.add_argument("--plot", default=None, metavar="OUT.png",
                   help="also run cd, mh, random (--budget-s each) and the exact DP, and save "
                        "their convergence (best cost over time) as a PNG")
    s.add_argument("--stages", type=_stages_arg, default="auto",
                   help="pipeline stages: auto (default: tried when one stage cannot fit "
                        "memory), search (always tried), or a count (1: no pipeline)")
    s.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b",
                   help="pipeline schedule (default 1f1b)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


def _stages_arg(v: str):
    if v in ("auto", "search"):
        return v
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise SearchCliError(f"--stages must be auto, search or a positive integer, got {v!r}")
    return n


# ---- building the problem -----------------------------------------------------------------------
def build_graph(model: str, batch=None, layers=12, d_model=768, heads=12, seq=1024, vocab=50257,
                num_classes=1000, tables=26, rows=1_000_000, dim=128, sizes=None):
    """The preset graph ``model`` with the given sizes; bad input raises `SearchCliError`."""
    from . import model_graphs
    if model not in MODELS:
        raise SearchCliError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    batch = _DEFAULT_BATCH[model] if batch is None else batch
    _positive("batch", batch)
    if model == "gpt":
        for n, v in (("layers", layers), ("d_model", d_model), ("heads", heads), ("seq", seq),
                     ("vocab", vocab)):
            _positive(n, v)
        if d_model % heads:
            raise SearchCliError(f"--d-model {d_model} is not divisible by --heads {heads}")
        return model_graphs.gpt(layers, d_model, heads, seq, batch, vocab, tied=True)
    if model in ("vgg13", "alexnet"):
        _positive("num_classes", num_classes)
        return getattr(model_graphs, model)(batch, num_classes)
    if model == "dlrm":
        for n, v in (("tables", tables), ("rows", rows), ("dim", dim)):
            _positive(n, v)
        bottom = (512, 256, dim)
        return model_graphs.dlrm(batch, tables=tables, rows=rows, dim=dim, bottom=bottom)
    sizes = list(sizes) if sizes is not None else [1024, 4096, 1024]
    if len(sizes) < 2:
        raise SearchCliError(f"--sizes needs at least two widths, got {sizes}")
    for v in sizes:
        _positive("sizes", v)
    return model_graphs.mlp(tuple(sizes), batch)


def build_cluster(preset="dgx-a100", nodes=None, devices_per_node=None, cluster_file=None):
    """A cost-model cluster from a preset or a cluster file, topology overridden."""
    from ..cost import Cluster
    _positive("nodes", nodes)
    _positive("devices_per_node", devices_per_node)
    if cluster_file is not None:
        c = Cluster.load(cluster_file)
        kw = {}
        if nodes is not None:
            kw["nodes"] = nodes
        if devices_per_node is not None:
            kw["devices_per_node"] = devices_per_node
        return dataclasses.replace(c, **kw) if kw else c
    kw = {} if devices_per_node is None else {"devices_per_node": devices_per_node}
    return Cluster.preset(preset, nodes=1 if nodes is None else nodes, **kw)


def _graph_from_args(args):
    return build_graph(args.model, args.batch, args.layers, args.d_model, args.heads, args.seq,
                       args.vocab, args.num_classes, args.tables, args.rows, args.dim,
                       args.sizes)


# ---- searching with a progress bar ----------------------------------------------------------------
FILL_BUDGET = {"cd": {"restarts": 10 ** 9}, "mh": {"iterations": 10 ** 12},
              "random": {"samples": 10 ** 12}}


def run_search(graph, cluster, algorithm="cd", seed=0, budget_s=30.0, memory_limit=None,
               progress=True, fill_budget=False, desc=None, stages="auto", schedule="1f1b"):
    """`sf.auto.search` in a worker thread while a tqdm bar shows elapsed / budget.

    ``fill_budget``: cd / mh / random run until the budget is spent (equal-time comparisons)
    instead of stopping on their default restart / iteration / sample counts. ``stages``,
    ``schedule``: `sbpflow.auto.pipeline_search.search`, whose checks refuse bad input
    (`SearchInputError`); a result over the memory limit is no warning here
    (`pipeline_search.find`): the command prints it as not fitting."""
    from .pipeline_search import find as search
    opts = dict(FILL_BUDGET.get(algorithm, {})) if fill_budget else {}
    budget = None if algorithm in ("exhaustive", "enumerate") else budget_s
    box: dict = {}

    def work():
        try:
            box["result"] = search(graph, cluster, algorithm, seed=seed, budget_s=budget,
                                   memory_limit=memory_limit, stages=stages,
                                   schedule=schedule, **opts)
        except BaseException as exc:   # re-raised on the caller's thread
            box["error"] = exc

    th = threading.Thread(target=work, name=f"sbpflow-search-{algorithm}", daemon=True)
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=round(budget, 1) if budget else None, desc=desc or algorithm,
                       unit="s", file=sys.stderr, leave=False,
                       bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s"
                       if budget else "{desc}: {n:.1f} s elapsed")
        except ImportError:
            bar = None
    t0 = time.perf_counter()
    th.start()
    while th.is_alive():
        th.join(0.1)
        if bar is not None:
            el = time.perf_counter() - t0
            bar.n = min(el, bar.total) if bar.total else el
            bar.refresh()
    if bar is not None:
        bar.close()
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, ValueError) and not isinstance(exc, SbpError):
            raise SearchCliError(f"search failed: {exc}") from exc
        raise exc
    return box["result"]


# ---- printing ------------------------------------------------------------------------------------
_TABLE_PAD = 14 + 12 + 16 + 28 + 22 + 22 + 22


def strategy_table(strategy, breakdown) -> str:
    """The strategy's per-layer table with predicted time (ms; compute included) and bytes
    per device (MB); an edge's redistribution is charged to its consumer."""
    pl = breakdown.per_layer
    extra = {n: f"{v['time'] * 1e3:>10.3f}{v['compute'] * 1e3:>12.3f}{v['bytes'] / 1e6:>12.2f}"
             for n, v in pl.items()}
    lines = strategy.table(extra).split("\n")
    pad = _TABLE_PAD + (6 if getattr(strategy, "pipeline", None) is not None else 0)
    lines[0] = lines[0].ljust(pad) + f"{'time ms':>10}{'compute ms':>12}{'MB/device':>12}"
    return "\n".join(lines)


def pipeline_line(strategy) -> str:
    """``stages: ...`` line of a found strategy: stage count, devices a stage, micro-batches
    and schedule (or one stage)."""
    pp = getattr(strategy, "pipeline", None)
    if pp is None:
        return "stages: 1 (no pipeline)\n"
    return (f"stages: {pp.stages} x {pp.devices} devices, micro-batches {pp.micro_batches}, "
            f"schedule {pp.schedule}\n")


def _summary_row(name, b, limit, ref):
    fits = "yes" if limit is None or b.memory["total"] <= limit else "NO"
    return (f"{name:<26}{b.time * 1e3:>12.3f}{b.comm_time * 1e3:>12.3f}{b.bytes / 1e9:>12.3f}"
            f"{b.memory['total'] / GiB:>12.2f}{fits:>6}{ref / b.time if b.time else 1:>10.2f}x")


def comparison(rows, limit) -> str:
    """rows: [(name, breakdown)]; speedup relative to the first row (data parallel)."""
    out = [f"{'strategy':<26}{'time ms':>12}{'comm ms':>12}{'GB/device':>12}{'mem GiB':>12}"
           f"{'fits':>6}{'vs DP':>11}"]
    ref = rows[0][1].time
    out += [_summary_row(n, b, limit, ref) for n, b in rows]
    return "\n".join(out)


# ---- plotting ------------------------------------------------------------------------------------
def plot_convergence(results: dict, path: str, title: str = "") -> bool:
    """Best cost over wall time of each `SearchResult` in ``results`` (name -> result); the
    exact optimum as a horizontal line from where it finishes. Returns False (with a message)
    when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping --plot "
              "(pip install matplotlib)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ymin, ymax = math.inf, 0.0
    for name, r in results.items():
        if not r.trace:
            continue
        if name in ("exhaustive", "enumerate"):
            x0, y = r.trace[-1][0], r.trace[-1][1] * 1e3
            ax.axhline(y, color="k", linestyle="--",
                       label=f"{name} optimum {y:.3f} ms (done at {r.seconds:.2f} s)")
            ax.plot([x0], [y], "ko")
            ymin, ymax = min(ymin, y), max(ymax, y)
            continue
        xs = [t for t, _ in r.trace] + [r.seconds]
        ys = [c * 1e3 for _, c in r.trace] + [r.trace[-1][1] * 1e3]
        ax.step(xs, ys, where="post", label=f"{name}: {ys[-1]:.3f} ms")
        ymin, ymax = min(ymin, min(ys)), max(ymax, max(ys))
    if ymax > 0 and ymax / max(ymin, 1e-12) > 20:
        ax.set_yscale("log")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("best predicted step time (ms; memory overflow penalised)")
    ax.set_title(title or "search convergence")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- the command ---------------------------------------------------------------------------------
def search_command(args) -> int:
    """``sbpflow search``: build the model and cluster, search, print tables. Returns the exit
    code: 0, or 2 after printing a bad-input error (an `SbpError`) to stderr."""
    try:
        return run_command(args)
    except SbpError as exc:
        print(f"sbpflow search: error: {exc}", file=sys.stderr)
        return 2


def run_command(args) -> int:
    """`search_command` without the error handling (raises `SbpError` on bad input)."""
    graph = _graph_from_args(args)
    cluster = build_cluster(args.cluster, args.nodes, args.devices_per_node, args.cluster_file)
    limit = _memory_limit(args, cluster)
    progress = not args.no_progress
    print(f"model:   {graph!r}")
    print(f"cluster: {cluster}")
    print(f"search:  {args.algorithm}, seed {args.seed}, budget {args.budget_s:g} s, memory "
          f"limit {limit / GiB:.4g} GiB/device\n")
    res = run_search(graph, cluster, args.algorithm, args.seed, args.budget_s, limit, progress,
                     stages=getattr(args, "stages", "auto"),
                     schedule=getattr(args, "schedule", "1f1b"))
    print(pipeline_line(res.strategy))
    print(f"== found strategy ({res.algorithm}: {res.seconds:.2f} s, {res.evaluations} "
          f"evaluations{'' if res.fits else ', DOES NOT FIT MEMORY'}) ==")
    print(strategy_table(res.strategy, res.breakdown))
    print(res.breakdown)
    rows = _baselines(graph, cluster, limit)
    rows.append((f"found ({res.algorithm})", res.breakdown))
    print("\n== comparison ==")
    print(comparison(rows, limit))
    if args.plot:
        _convergence(args, graph, cluster, limit, progress, {args.algorithm: res})
    return 0


def _memory_limit(args, cluster) -> float:
    """Check ``--budget-s`` and ``--memory-limit``; the limit in bytes (default: the
    cluster's memory per device)."""
    if args.budget_s is not None and not args.budget_s > 0:
        raise SearchCliError(f"--budget-s must be > 0, got {args.budget_s}")
    if args.memory_limit is not None and not args.memory_limit > 0:
        raise SearchCliError(f"--memory-limit must be > 0 GiB, got {args.memory_limit}")
    return args.memory_limit * GiB if args.memory_limit is not None else \
        cluster.memory_per_device


def _baselines(graph, cluster, limit) -> list:
    """Print data parallelism and the best Megatron t x d under ``limit``; their
    ``(name, breakdown)`` rows for the comparison (those that exist)."""
    from .baselines import best_megatron, data_parallel
    from .evaluate import evaluate
    rows = []
    try:
        dp = data_parallel(graph, cluster)
        dpb = evaluate(graph, dp, cluster)
        print("\n== data parallel ==")
        print(dpb)
        rows.append(("data parallel", dpb))
    except ValueError as exc:
        print(f"\n== data parallel: not expressible ({exc}) ==")
    meg = best_megatron(graph, cluster, limit)
    if meg is None:
        print("\n== best Megatron t x d: none fits the memory limit ==")
    else:
        s, b, tp = meg
        dpd = cluster.world_size // tp
        print(f"\n== best Megatron t x d under memory: tp {tp} x dp {dpd} ==")
        print(b)
        rows.append((f"Megatron tp{tp} x dp{dpd}", b))
    return rows


def _convergence(args, graph, cluster, limit, progress: bool, results: dict) -> None:
    """``--plot``: run every algorithm for the same budget, print how close each came to the
    optimum and plot their convergence to ``args.plot``."""
    for alg in ("cd", "mh", "random", "exhaustive"):
        if alg in results:
            continue
        results[alg] = run_search(graph, cluster, alg, args.seed, args.budget_s, limit,
                                  progress, fill_budget=True, desc=f"plot: {alg}")
    # the headline algorithm was run without fill_budget; rerun it so all get equal time
    if args.algorithm in ("cd", "mh", "random"):
        results[args.algorithm] = run_search(graph, cluster, args.algorithm, args.seed,
                                             args.budget_s, limit, progress, fill_budget=True,
                                             desc=f"plot: {args.algorithm}")
    print("\n== convergence ==")
    opt = results["exhaustive"].cost
    for alg in ("cd", "mh", "random", "exhaustive"):
        r = results[alg]
        print(f"{alg:<12}{r.cost * 1e3:>14.3f} ms{r.cost / opt:>10.4f}x optimum"
              f"{r.seconds:>10.2f} s")
    title = (f"{graph.name} on {cluster.world_size} devices ({cluster.name})")
    if plot_convergence({k: results[k] for k in ("cd", "mh", "random", "exhaustive")},
                        args.plot, title):
        print(f"convergence plot written to {args.plot}")
