"""``sf.auto.search``: the one-stage search (`strategy_search.one_stage_search`) and pipeline
stages in the space (Alpa's inter-operator pass over a chain of layers).

Tried when one stage cannot fit memory (``stages="auto"``) or always (``"search"``). Stage
counts S (whole nodes or equal parts of a node a stage) go from the most stages down; per S
the chain is cut into stages balanced by the layers' least times, the fewest micro-batches M
that can fit memory get each stage searched quickly (one descent of single-layer moves),
cuts move off the slowest stage while that helps, then M goes up (S x 2^k and divisors of the
batch, whole sequences a micro-batch) with the strategies re-priced. With attention,
Megatron-LM's layouts (tp x dp a stage) are priced at every S and M beside them. The best
pipeline gets its stages searched with the algorithm asked for. See docs/auto.md,
'Pipeline stages'."""

from __future__ import annotations

import dataclasses
import math
import time
import warnings

import numpy as np
from typing import NamedTuple

from ..caches import collector_paused
from ..errors import SearchInputError
from .baselines import _key_counts
from .baselines import megatron_layers as _megatron_layers
from .baselines import megatron_pipeline, megatron_stages
from .checks import MemoryLimitWarning, check_schedule, check_search, check_stages
from .evaluate import Evaluator
from .pipeline_cost import balanced_cuts, evaluate, stage_cost, stage_graph, sub_cluster
from .strategy_search import ALGORITHMS, PENALTY, SearchResult, check_memory_limit
from .strategy_search import one_stage_search as _search_one
from .space import PipelineShape, Strategy, layer_space, splits_sequences, whole_sequences

__all__ = ["search", "find", "stage_counts", "explored_counts", "one_stage_floor",
           "micro_batch_ladder", "SCHEDULES"]

SCHEDULES = ("1f1b", "gpipe")
# default options of the final stage searches (the caller's options override them): one
# descent from the quick strategies; joint moves only over edge tables of at most 40 000
# layout pairs (a stage of GPT-3 on 64 devices has tables of 10^5 pairs, whose joint moves
# cost minutes of pricing for a fraction of a percent)
POLISH = {"cd": {"restarts": 0, "window_max_entries": 40_000}}


def stage_counts(graph, cluster, max_stages: int | None = None) -> list:
    """Stage counts S > 1 the chain can be cut into: S divides the devices into stages of
    whole nodes or equal parts of a node, at most one stage a layer (and ``max_stages``)."""
    p, n = cluster.world_size, len(graph.layers)
    top = min(n, p, max_stages or n)
    return [s for s in range(2, top + 1) if p % s == 0 and sub_cluster(cluster, p // s)]


def explored_counts(graph, cluster) -> list:
    """The stage counts the pass tries by itself: `stage_counts` up to half the repeats of
    the most repeated layer kind (at least two GPT blocks a stage, cut at block starts, so
    stages are alike), or half the layers when no kind repeats four times."""
    counts = _key_counts(graph)
    most = max(counts.values())
    return stage_counts(graph, cluster, most // 2 if most >= 4 else len(graph.layers) // 2)


def _cut_points(graph, stages: int) -> list:
    """Where stages may start: before each layer of the most repeated kind of layer (a GPT's
    blocks, so middle stages are alike and searched once) when it repeats at least twice a
    stage, else before any layer."""
    counts = _key_counts(graph)
    key = max(counts, key=counts.get)
    if counts[key] >= 2 * stages:
        return [i for i, l in enumerate(graph.layers) if l.key == key and i > 0]
    return list(range(1, len(graph.layers)))


class _SearchedStage(NamedTuple):
    result: SearchResult
    cost: object        # pipeline.StageCost


class _Found(NamedTuple):
    """A pipeline tried: its objective, stages, strategy, breakdown and stage starts."""

    objective: float
    stages: list
    strategy: Strategy
    breakdown: object
    starts: list


class _Explorer:
    """The pipelines tried for one search call: stage searches cached by (layer keys,
    devices, micro-batches, in-flight count), shared node terms and edge tables, per-layer
    memory floors."""

    def __init__(self, graph, cluster, algorithm, seed, limit, max_dims, zero, schedule,
                 options, deadline):
        self.graph, self.cluster, self.algorithm, self.seed = graph, cluster, algorithm, seed
        self.limit, self.max_dims, self.zero = limit, max_dims, zero
        self.recompute = options.pop("recompute", False)
        self.schedule, self.options, self.deadline = schedule, options, deadline
        self.cache: dict = {}
        self.shared: dict = {}
        self._floors: dict = {}
        self._weights: dict = {}
        self._evaluators: dict = {}
        self.evaluations = 0
        self.compute = sum(3.0 * l.flops for l in graph.layers) / cluster.device_flops

    def stage(self, start: int, end: int, inflight: int, pp: PipelineShape, start_from=None,
              quick: bool = True) -> _SearchedStage:
        """The searched strategy of layers ``start:end`` as stage ``k`` of ``pp`` (cached).
        ``inflight``: micro-batches of activations kept. ``quick``: one coordinate descent
        of single-layer moves from data parallelism (what the pass compares pipelines by);
        else the search asked for (``start_from``: the layers' strategies a descent starts
        from)."""
        sub = sub_cluster(self.cluster, pp.devices)
        layers = self.graph.layers[start:end]
        key = (tuple(l.key for l in layers), pp.devices, pp.micro_batches, inflight, quick)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        g = stage_graph(self.graph, start, end)
        budget = None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())
        shared = self.shared.setdefault((pp.devices, pp.micro_batches), {})
        algorithm, opts = ("cd", {"restarts": 0, "window": 1}) if quick else \
            (self.algorithm, dict(POLISH.get(self.algorithm, {}), **self.options))
        if start_from is not None and algorithm in ("cd", "mh", "exhaustive"):
            opts["start"] = Strategy(g, [dataclasses.replace(x, stage=0) for x in start_from])
        r = _search_one(g, sub, algorithm, self.seed, budget, self.limit or float("inf"),
                        pp.micro_batches, self.max_dims, self.zero, inflight, shared,
                        self.recompute, **opts)
        self.evaluations += r.evaluations
        out = _SearchedStage(r, stage_cost(r.breakdown, pp.micro_batches, inflight))
        self.cache[key] = out
        return out

    def _evaluator(self, devices: int) -> Evaluator:
        """One `Evaluator` (one micro-batch) per stage size: its node terms are cached."""
        if devices not in self._evaluators:
            self._evaluators[devices] = Evaluator(self.graph, sub_cluster(self.cluster, devices))
        return self._evaluators[devices]

    def weights(self, devices: int) -> list:
        """Each layer's least node time (compute, gradient sync) on a stage's devices."""
        if devices not in self._weights:
            ev = self._evaluator(devices)
            memo: dict = {}
            for l in self.graph.layers:
                if l.key not in memo:
                    memo[l.key] = min(ev.node_terms(l, s)["time"]
                                      for s in layer_space(l, devices, self.max_dims))
            self._weights[devices] = [memo[l.key] for l in self.graph.layers]
        return self._weights[devices]

    def _floor_arrays(self, devices: int, micro_batches: int) -> list:
        """Per layer: (memory without activations, activations of the whole batch) of each
        candidate on ``devices`` devices that keeps whole sequences at ``micro_batches``."""
        if (devices, micro_batches) not in self._floors:
            ev = self._evaluator(devices)
            memo: dict = {}
            for l in self.graph.layers:
                if l.key not in memo:
                    mem = [ev.node_memory(l, s)
                           for s in layer_space(l, devices, self.max_dims, self.zero,
                                                self.recompute, micro_batches)]
                    act = np.array([m["activations"] for m in mem])
                    memo[l.key] = (np.array([m["total"] for m in mem]) - act, act)
            self._floors[devices, micro_batches] = [memo[l.key] for l in self.graph.layers]
        return self._floors[devices, micro_batches]

    def can_fit(self, starts: list, pp: PipelineShape) -> bool:
        """Whether every stage's least memory per device (each layer at its least-memory
        candidate, ``in_flight`` micro-batches of activations) is within the limit."""
        if self.limit is None:
            return True
        arrays = self._floor_arrays(pp.devices, pp.micro_batches)
        ends = starts[1:] + [len(self.graph.layers)]
        for k, (a, b) in enumerate(zip(starts, ends)):
            f = pp.in_flight(k) / pp.micro_batches
            if sum(float((st + f * act).min()) for st, act in arrays[a:b]) > self.limit:
                return False
        return True

    def objective(self, starts: list, pp: PipelineShape, start_from=None,
                  quick: bool = True) -> _Found:
        """The pipeline whose stages start at ``starts``, each searched (`stage`)."""
        ends = starts[1:] + [len(self.graph.layers)]
        # stages of the same layers are searched once, keeping the most micro-batches in
        # flight any of them keeps (1F1B: the earliest one's), so the result fits them all
        most: dict = {}
        for k, (a, b) in enumerate(zip(starts, ends)):
            key = tuple(l.key for l in self.graph.layers[a:b])
            most[key] = max(most.get(key, 0), pp.in_flight(k))
        stages = [self.stage(a, b, most[tuple(l.key for l in self.graph.layers[a:b])], pp,
                             None if start_from is None else start_from[a:b], quick)
                  for a, b in zip(starts, ends)]
        layers = []
        for k, st in enumerate(stages):
            layers += [dataclasses.replace(x, stage=k) for x in st.result.strategy.layers]
        return self.priced(Strategy(self.graph, layers, pp), stages, starts)

    def priced(self, strategy: Strategy, stages: list, starts: list) -> _Found:
        b = evaluate(self.graph, strategy, self.cluster)
        mem = max(b.stage_memory)
        pen = 0.0 if self.limit is None else PENALTY * max(0.0, mem - self.limit) / self.limit
        return _Found(b.time + pen, stages, strategy, b, starts)

    def with_micro_batches(self, found: _Found, m: int) -> _Found | None:
        """``found``'s stages and layer strategies run with ``m`` micro-batches (no search);
        None when one of them would then give a device part of a sequence (an attention
        layer's batch split must divide ``batch // m``; it then fails at every multiple of
        ``m`` too)."""
        if not whole_sequences(self.graph, m) or any(
                splits_sequences(l, x, m) for l, x in zip(self.graph.layers,
                                                          found.strategy.layers)):
            return None
        pp = found.strategy.pipeline._replace(micro_batches=m)
        return self.priced(Strategy(self.graph, found.strategy.layers, pp), found.stages,
                           found.starts)

    def rebalance(self, best: _Found, pp: PipelineShape, points: list, rounds: int) -> _Found:
        """Move one cut point at a time off the slowest stage (to the neighbouring allowed
        point) while the objective goes down."""
        for _ in range(rounds):
            starts, b = best.starts, best.breakdown
            k = max(range(len(starts)), key=lambda i: b.stage_times[i])
            tried = []
            if k > 0:       # the slowest stage starts later
                nxt = [p for p in points if p > starts[k]]
                end = starts[k + 1] if k + 1 < len(starts) else len(self.graph.layers)
                if nxt and nxt[0] < end:
                    tried.append(starts[:k] + [nxt[0]] + starts[k + 1:])
            if k + 1 < len(starts):   # the next stage starts earlier
                prv = [p for p in points if p < starts[k + 1]]
                if prv and prv[-1] > starts[k]:
                    tried.append(starts[:k + 1] + [prv[-1]] + starts[k + 2:])
            moved = False
            for cand in tried:
                if not self.can_fit(cand, pp) or not self._may_help(best, cand, k):
                    continue
                got = self.objective(cand, pp)
                if got.objective < best.objective - 1e-12 * abs(best.objective):
                    best, moved = got, True
                    break
            if not moved or self.out_of_time():
                break
        return best

    def _may_help(self, best: _Found, cand: list, k: int) -> bool:
        """Whether moving the layers between ``best.starts`` and ``cand`` off the slowest
        stage ``k`` may lower its time: their share of stage k's time (by the layers' least
        times, `weights`) added to the neighbour that takes them stays below stage k's."""
        starts, times = best.starts, best.breakdown.stage_times
        w = self.weights(best.strategy.pipeline.devices)
        n = len(self.graph.layers)
        j = next(i for i, (a, b) in enumerate(zip(starts, cand)) if a != b)
        lo, hi = sorted((starts[j], cand[j]))
        end = starts[k + 1] if k + 1 < len(starts) else n
        total = sum(w[starts[k]:end])
        share = times[k] * sum(w[lo:hi]) / total if total > 0 else 0.0
        other = k - 1 if j == k else k + 1
        return times[other] + share < times[k]

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def cuts(self, s: int, m: int):
        """(pipeline, cut points, balanced stage starts or None) for ``s`` stages."""
        pp = PipelineShape(s, self.cluster.world_size // s, m, self.schedule)
        points = _cut_points(self.graph, s)
        return pp, points, balanced_cuts(self.weights(pp.devices), s, points)

    def megatron_seed(self, s: int, ladder: list) -> _Found | None:
        """The best Megatron-LM layout on ``s`` stages (`baselines.megatron_pipeline`: tensor
        parallel tp within a node, data parallel over the rest of a stage; cut at Megatron's
        equal blocks or balanced by the layout's own layer times) over tp and the micro-batch
        counts of ``ladder``: priced, not searched (None if none keeps whole sequences). Why:
        the quick stage searches start from data parallelism and move one layer at a time,
        and the strategies searched at the first count that fits are kept at larger counts,
        so they can miss this layout, in which every layer of a block changes together."""
        devices = self.cluster.world_size // s
        heads = [l.attrs["heads"] for l in self.graph.layers
                 if l.kind == "attention" and "heads" in l.attrs]
        best = None
        for tp in range(1, min(devices, self.cluster.devices_per_node) + 1):
            if devices % tp or any(h % tp for h in heads):
                continue
            try:
                layers = _megatron_layers(self.graph, tp, devices // tp)
            except ValueError:
                continue
            for starts in self._seed_cuts(s, devices, layers):
                got = self._megatron_ladder(starts, tp, devices // tp, ladder)
                if got is not None and (best is None or got.objective < best.objective):
                    best = got
        return best

    def _seed_cuts(self, s: int, devices: int, layers: list) -> list:
        """Stage starts for a seed: Megatron's (`baselines.megatron_stages`) and cuts
        balanced by ``layers``' own times on a stage's devices (at the cut points of
        `cuts`); those that exist, without repeats."""
        ev = self._evaluator(devices)
        memo: dict = {}
        for l, x in zip(self.graph.layers, layers):
            if l.key not in memo:
                memo[l.key] = ev.node_terms(l, x)["time"]
        balanced = balanced_cuts([memo[l.key] for l in self.graph.layers], s,
                                 _cut_points(self.graph, s))
        out = [balanced] if balanced else []
        try:
            megatron = megatron_stages(self.graph, s)
        except ValueError:
            return out
        return out + [megatron] if megatron != balanced else out

    def _megatron_ladder(self, starts: list, tp: int, dp: int, ladder: list) -> _Found | None:
        """Megatron's tp x dp on the stages at ``starts``, priced up the micro-batch counts of
        ``ladder`` (those that keep whole sequences) until the objective rises at a count
        that fits memory (more micro-batches: less memory and bubble, more per-micro-batch
        latency, so past there it rises on); the least."""
        best, st = None, None
        for m in ladder:
            if st is None:
                st = megatron_pipeline(self.graph, tp, dp, starts, m, self.schedule)
            else:
                st = Strategy(self.graph, st.layers, st.pipeline._replace(micro_batches=m))
            if any(splits_sequences(l, x, m) for l, x in zip(self.graph.layers, st.layers)):
                continue
            got = self.priced(st, [], starts)
            if best is not None and got.objective >= best.objective and \
                    _fits(got.breakdown, self.limit):
                break
            if best is None or got.objective < best.objective:
                best = got
        return best

    def explore(self, s: int, m: int) -> _Found | None:
        """The best pipeline found with ``s`` stages and ``m`` micro-batches: balanced cuts,
        stages searched, cuts moved off the slowest stage (None if the chain cannot be cut
        so, or no cut of it can fit)."""
        pp, points, starts = self.cuts(s, m)
        if starts is None or not self.can_fit(starts, pp):
            return None
        return self.rebalance(self.objective(starts, pp), pp, points, min(2 * s, 8))


def _micro_limit(graph) -> int:
    """The most micro-batches: one sequence (or sample) each."""
    return max(1, min(l.attrs.get("batch", l.input_shape[0]) for l in graph.layers))


def micro_batch_ladder(graph, s: int) -> list:
    """The micro-batch counts the pipeline pass tries for ``s`` stages, increasing: ``s x 2^k``
    (fewer when the batch is smaller) and, for a graph with attention, the divisors of its
    batch between them (Megatron's 48 or 96 are not ``s x 2^k``), keeping only counts whose
    micro-batches hold whole sequences (`whole_sequences`)."""
    m_max = _micro_limit(graph)
    out, m = set(), min(s, m_max)
    while m <= m_max:
        out.add(m)
        m *= 2
    batches = {l.attrs["batch"] for l in graph.layers
               if l.kind == "attention" and "batch" in l.attrs}
    lo = min(s, m_max)
    for b in batches:
        out |= {d for d in range(lo, min(b, m_max) + 1) if b % d == 0}
    return sorted(m for m in out if whole_sequences(graph, m))


def one_stage_floor(graph, cluster, micro_batches: int = 1, max_dims: int = 3,
                    zero: bool = False, recompute: bool = False,
                    shared: dict | None = None) -> float:
    """The least memory per device any one-stage strategy can have: per layer the least of
    its candidates' memory, summed (memory is a sum of per-layer terms, so this is exact:
    each layer takes its least-memory candidate; nothing is priced). ``shared``: the caches
    of the one-stage search that follows (`Problem`), which then finds these terms kept."""
    if not whole_sequences(graph, micro_batches):
        return math.inf      # no strategy keeps whole sequences
    ev = Evaluator(graph, cluster, micro_batches,
                   None if shared is None else shared.setdefault("evaluator", {}))
    memo: dict = {}
    total = 0.0
    for i, l in enumerate(graph.layers):
        key = (l.key, not graph.succs[i])
        if key not in memo:
            memo[key] = min(ev.node_memory(l, s)["total"]
                            for s in layer_space(l, cluster.world_size, max_dims, zero,
                                                 recompute, micro_batches))
        total += memo[key]
    return total


def _check_stage_count(graph, cluster, stages) -> None:
    if isinstance(stages, int) and stages not in stage_counts(graph, cluster):
        counts = stage_counts(graph, cluster)
        raise SearchInputError(f"search: stages={stages}: {graph.name} on {cluster} cannot "
                               f"be cut into {stages} stages of whole nodes or equal parts "
                               f"of a node (at most one a layer); give one of {counts or [1]}")


def _check_args(graph, algorithm, budget_s, micro_batches, stages, schedule) -> None:
    """`SearchInputError` for bad input to `search` (`checks`)."""
    check_search(graph, algorithm, ALGORITHMS, budget_s, micro_batches)
    check_stages(stages)
    check_schedule(schedule, SCHEDULES)


def _warn_over_limit(result: SearchResult, graph, cluster, limit, micro_batches, max_dims,
                     zero, recompute, stages) -> None:
    """A `MemoryLimitWarning` when ``result`` is over ``limit`` (bytes, None: none): how far,
    the least memory any one-stage strategy needs at its micro-batches (`one_stage_floor`,
    exact), and what could make a strategy fit."""
    need = result.breakdown.memory["total"]
    if limit is None or need <= limit:
        return
    m = result.micro_batches or 1  # a pipeline's, or the one stage's (the last tried: auto)
    floor = one_stage_floor(graph, cluster, m, max_dims, zero, recompute)
    if floor > limit:
        why = (f"no one-stage strategy at {m} micro-batch(es) fits: the least any needs is "
               f"{_amount(floor)}")
    else:
        why = (f"a one-stage strategy needs at least {_amount(floor)}, so one may fit that "
               f"the search did not find: algorithm='exhaustive' finds the optimum")
    allow = [a for a, given in (("zero=True", zero), ("recompute=True", recompute),
                                ("micro_batches='auto'", micro_batches == "auto"),
                                ("stages='search'", stages == "search")) if not given]
    warnings.warn(
        f"sf.auto.search: the strategy found needs {_amount(need)} a device, over the memory "
        f"limit of {_amount(limit)} ({why}); it is returned anyway (result.fits is False): "
        + (f"allow {', '.join(allow)}, " if allow else "") + "use more devices or raise "
        f"memory_limit", MemoryLimitWarning, stacklevel=3)


def _amount(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit it reaches, 4 significant digits."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes:.4g} B"


def search(graph, cluster, algorithm: str = "cd", seed: int = 0, budget_s: float | None = None,
           memory_limit: float | None = None, micro_batches=1, max_dims: int = 3,
           zero: bool = False, stages="auto", schedule: str = "1f1b",
           **options) -> SearchResult:
    """`find` (the arguments and the answer are its), and a `MemoryLimitWarning` when the
    answer is over the memory limit (no strategy found fits): by how much, the least memory
    any one-stage strategy needs (`one_stage_floor`), and what to allow. The answer is
    returned all the same (``result.fits`` is False): it is the least excess found."""
    result = find(graph, cluster, algorithm, seed, budget_s, memory_limit, micro_batches,
                  max_dims, zero, stages, schedule, **options)
    if not result.fits:
        _warn_over_limit(result, graph, cluster, result.memory_limit, micro_batches, max_dims,
                         zero, options.get("recompute", False), stages)
    return result


@collector_paused()
def find(graph, cluster, algorithm: str = "cd", seed: int = 0, budget_s: float | None = None,
         memory_limit: float | None = None, micro_batches=1, max_dims: int = 3,
         zero: bool = False, stages="auto", schedule: str = "1f1b",
         **options) -> SearchResult:
    """Search a strategy for ``graph`` on ``cluster.world_size`` devices: one stage, and for
    a chain pipelines of S stages and M micro-batches (module doc); the least objective
    (predicted step time, plus a penalty when over the memory limit) wins.

    Arguments as `strategy_search.one_stage_search` (``micro_batches``: the one-stage search's
    gradient accumulation; a pipeline chooses its own). ``stages``:

    * ``"auto"`` (default): pipelines are tried only when no one-stage strategy fits the
      memory limit at ``micro_batches`` (`one_stage_floor`) or the one-stage search finds
      none that does; otherwise the result is the one-stage search's, unchanged;
    * ``"search"``: pipelines are always tried beside one stage;
    * ``1``: one stage only; ``S > 1``: S stages only.

    ``schedule``: ``"1f1b"`` (default) or ``"gpipe"``. ``recompute=True`` (an option of
    `strategy_search.one_stage_search`) puts per-layer activation recomputation in the space; with
    ``zero=True``, ``micro_batches="auto"`` and ``stages="search"`` memory is met by the
    cheapest combination of ZeRO, recomputation, micro-batches and pipelining.

    The cyclic garbage collector is paused meanwhile (`sbpflow.caches.collector_paused`). Bad
    input raises `SearchInputError` naming the argument, its value and the fix (`checks`).
    `search` also warns when the result is over the memory limit; this does not (for callers
    that say so themselves: `parallelize`)."""
    _check_args(graph, algorithm, budget_s, micro_batches, stages, schedule)
    memory_limit, limit = _limits(memory_limit, cluster)
    args = (graph, cluster, algorithm, seed, budget_s, memory_limit, micro_batches, max_dims,
            zero)
    chain = graph.is_chain and len(graph.layers) >= 2
    if stages == 1 or (stages in ("auto", "search") and not chain):
        return _search_one(*args, **options)
    if not chain:
        raise SearchInputError(f"search: stages={stages}: {graph.name} is not a chain of "
                               f"layers, and pipeline stages cut a chain; give stages=1 or "
                               f"'auto'")
    m1 = 1 if micro_batches == "auto" else micro_batches
    shared = None if micro_batches == "auto" else {}   # the floor's terms, kept for `single`
    single = None  # the one-stage result, once searched
    if stages == "auto" and (limit is None or
                             one_stage_floor(graph, cluster, m1, max_dims, zero,
                                             options.get("recompute", False), shared) <= limit):
        single = _search_one(*args, shared=shared, **options)
        if limit is None or single.fits:
            return single   # (else: nothing found under the limit, though it exists)
    _check_stage_count(graph, cluster, stages)
    t0 = time.perf_counter()
    deadline = None if budget_s is None else t0 + budget_s
    ex = _Explorer(graph, cluster, algorithm, seed, limit, max_dims, zero, schedule,
                   {k: v for k, v in options.items() if k != "start"}, deadline)
    counts = [stages] if isinstance(stages, int) else explored_counts(graph, cluster)
    found = _explore_all(ex, counts)
    if single is None and (stages == "search" or (stages == "auto" and (
            found is None or not _fits(found.breakdown, limit) or micro_batches == "auto"))):
        # one stage too: always with "search"; with "auto" when no pipeline fits (the least
        # excess wins) or when more micro-batches may let one stage fit
        single = _cheapest_one_stage(args, options) if stages == "search" and \
            micro_batches == "auto" else _search_one(*args, **options)
    return _result(graph, found, single, ex, algorithm, limit, t0)


def _limits(memory_limit: float | None, cluster) -> tuple:
    """The memory limit a search is given (checked; else the cluster's per device), and the
    one it prunes with (None for none or an infinite one)."""
    check_memory_limit(memory_limit)
    if memory_limit is None:
        memory_limit = getattr(cluster, "memory_per_device", None)
    return memory_limit, (None if memory_limit is None or math.isinf(memory_limit)
                          else memory_limit)


def _cheapest_one_stage(args: tuple, options: dict) -> SearchResult:
    """One stage with ``micro_batches="auto"`` as the least step time: micro-batches double
    from 1 until the strategy fits, then on while the objective goes down (more micro-batches
    cost only latency, which may be cheaper than the recomputation or ZeRO gathers that the
    first fitting count needs)."""
    graph = args[0]
    limit_m = min(l.input_shape[0] for l in graph.layers)
    best, m = None, 1
    while m <= limit_m and whole_sequences(graph, m):
        r = _search_one(*args[:6], m, *args[7:], **options)
        if best is not None and best.fits and r.cost >= best.cost:
            break
        if best is None or r.cost < best.cost:
            best = r
        m *= 2
    return best


def _fits(breakdown, limit) -> bool:
    return limit is None or breakdown.memory["total"] <= limit


def _explore_all(ex: _Explorer, counts: list) -> _Found | None:
    """The best pipeline over stage counts and micro-batch counts (None if none): the best
    of the quick searches (`_explore_searched`) and, for a graph with attention, of
    Megatron-LM's layouts at every stage count (`_Explorer.megatron_seed`, priced only:
    cheap). The best (S, M, cuts) gets its
    stages searched with the algorithm asked for, starting from its layer strategies (at the
    M they were searched or priced at: for the quick searches the first M, whose edge tables
    are priced already), then re-priced at its M; the better is kept."""
    top, searched_at = _explore_searched(ex, counts)
    # Megatron-LM's layouts are a transformer's: a graph without attention is not seeded
    transformer = any(l.kind == "attention" for l in ex.graph.layers)
    for s in counts if transformer else ():
        if ex.out_of_time():
            break
        seed = ex.megatron_seed(s, micro_batch_ladder(ex.graph, s))
        if seed is not None and (top is None or seed.objective < top.objective):
            top, searched_at = seed, seed.strategy.pipeline
    if top is not None and not ex.out_of_time():
        again = ex.objective(top.starts, searched_at, top.strategy.layers, quick=False)
        again = ex.with_micro_batches(again, top.strategy.pipeline.micro_batches)
        if again is not None and again.objective < top.objective:
            top = again
    return top


def _explore_searched(ex: _Explorer, counts: list) -> tuple:
    """The best pipeline of quick stage searches and the `PipelineShape` it was searched at, or
    (None, None). Stage counts go from the most stages down (the cheapest searches first:
    the fewest devices a stage) and stop after the first count whose best is worse than the
    previous count's (a heuristic: step time against stage count is taken to have one
    minimum). Per stage count S: the fewest micro-batches M of `micro_batch_ladder` whose
    balanced cuts can fit memory gets its stages searched quickly (`_Explorer.stage`) and
    cuts moved; then M goes up the ladder with the same layer strategies re-priced (no
    search; counts at which one would split a sequence skipped) while the objective goes
    down."""
    top, searched_at, last = None, None, math.inf
    for s in sorted(counts, reverse=True):
        if ex.out_of_time():
            break
        if top is not None and ex.compute / ex.cluster.world_size >= top.objective:
            break        # compute alone (no bubble) cannot beat the best: nor can more stages
        ladder = micro_batch_ladder(ex.graph, s)
        k = 0
        while k < len(ladder):
            pp, _, starts = ex.cuts(s, ladder[k])
            if starts is None or ex.can_fit(starts, pp):
                break
            k += 1
        if k == len(ladder):
            continue
        found = best = ex.explore(s, ladder[k])
        if best is None:
            continue
        for m in ladder[k + 1:]:
            nxt = ex.with_micro_batches(best, m)
            if nxt is None:
                continue     # a strategy would split a sequence here; a later count may not
            if nxt.objective >= best.objective:
                break
            best = nxt
        if top is None or best.objective < top.objective:
            top, searched_at = best, found.strategy.pipeline
        if best.objective > last:
            break        # worse than the next larger count: fewer stages stop here
        last = best.objective
    return top, searched_at


def _result(graph, found, single, ex: _Explorer, algorithm: str, limit,
            t0) -> SearchResult:
    if found is None and single is None:
        raise SearchInputError(f"search: no pipeline of the stage counts asked for can be "
                               f"cut from the chain of layers of {graph.name}; ask for fewer "
                               f"stages")
    if found is None or (single is not None and single.cost <= found.objective):
        if single is not None:
            single.seconds = time.perf_counter() - t0
            single.evaluations += ex.evaluations
        return single
    obj, strategy, b = found.objective, found.strategy, found.breakdown
    edge = sum(int(t.known.sum()) for sh in ex.shared.values()
               for t in sh.get("tables", {}).values())
    seconds = time.perf_counter() - t0
    return SearchResult(strategy, b, [(seconds, obj)], algorithm, obj, seconds,
                        ex.evaluations + (single.evaluations if single is not None else 0),
                        strategy.pipeline.micro_batches, limit, edge)
