"""The one-stage strategy search (`one_stage_search`), and the names of its parts.

The problem (`search_problem.Problem`: per-layer terms and edge tables, `edge_tables`) is
searched by one algorithm of ``ALGORITHMS``: ``"cd"`` coordinate descent with path moves and
restarts (default, `search_descent`), ``"exhaustive"`` exact dynamic programming over an in-tree
of layers and ``"enumerate"`` (`search_exact`), ``"mh"`` Metropolis-Hastings and ``"random"``
(`search_sampling`). A memory limit is a penalty (a Lagrangian price in the DP). The names
other modules and tests import from here (``Problem``, ``PENALTY``, ``_dp_once``,
``_coordinate_descent``) stay importable. See docs/auto.md, 'How the search works'.
"""

from __future__ import annotations

import math
import numbers
import random
import time
from dataclasses import dataclass, field

from ..caches import collector_paused
from ..errors import CostError
from .checks import check_search
from .evaluate import Breakdown
from .search_descent import coordinate_descent
from .search_exact import dp_once, enumerate_strategies, exhaustive
from .search_problem import PENALTY, Problem
from .search_sampling import metropolis, random_search
from .space import Strategy, check_whole_sequences, whole_sequences

__all__ = ["SearchResult", "one_stage_search", "Problem", "PENALTY", "ALGORITHMS",
           "check_memory_limit"]

# the names tests/auto/test_search.py reads (the algorithms were private here before the split)
_coordinate_descent, _dp_once = coordinate_descent, dp_once


@dataclass
class SearchResult:
    strategy: Strategy
    breakdown: Breakdown
    trace: list = field(default_factory=list)   # (seconds since start, best objective)
    algorithm: str = ""
    cost: float = 0.0                           # objective (= time when memory fits)
    seconds: float = 0.0
    evaluations: int = 0
    micro_batches: int = 1
    memory_limit: float | None = None
    edge_evaluations: int = 0                   # edge-cost table entries computed (the work)

    @property
    def fits(self) -> bool:
        """The strategy's memory per device is within the limit."""
        return self.memory_limit is None or self.breakdown.memory["total"] <= self.memory_limit

    def __str__(self) -> str:
        return (f"{self.algorithm}: cost {self.cost * 1e3:.3f} ms in {self.seconds:.2f} s "
                f"({self.evaluations} evaluations)\n{self.breakdown}\n{self.strategy.table()}")


ALGORITHMS = {"cd": coordinate_descent, "mh": metropolis, "random": random_search,
              "exhaustive": exhaustive, "enumerate": enumerate_strategies}


def check_memory_limit(memory_limit) -> None:
    """A memory limit is None (the cluster's memory, if any) or a number of bytes > 0 (inf:
    none); anything else raises `CostError` (a limit of 0 made the search divide by it)."""
    if memory_limit is None:
        return
    ok = isinstance(memory_limit, numbers.Real) and not isinstance(memory_limit, bool)
    if not ok or math.isnan(memory_limit) or memory_limit <= 0:
        raise CostError(f"memory_limit must be a number of bytes > 0 (or None: the cluster's "
                        f"memory_per_device), got {memory_limit!r}; e.g. 80 * 2**30 for 80 GiB")


def _start_index(cands: list, s) -> int:
    """Where a descent from ``s`` starts among ``cands``: ``s`` itself, else the first candidate
    with its mesh and activation layouts (a stage of a pipeline gives a tied layer its own copy
    of the weight, which the whole model's strategy leaves out), else the first."""
    try:
        return cands.index(s)
    except ValueError:
        return next((k for k, c in enumerate(cands)
                     if (c.mesh, c.input, c.output) == (s.mesh, s.input, s.output)), 0)


@collector_paused()
def one_stage_search(graph, cluster, algorithm: str = "cd", seed: int = 0,
                     budget_s: float | None = None, memory_limit: float | None = None,
                     micro_batches=1, max_dims: int = 3,
                     zero: bool = False, in_flight: int = 1, shared: dict | None = None,
                     recompute: bool = False, **options) -> SearchResult:
    """Search a one-stage strategy for ``graph`` on ``cluster.world_size`` devices
    (``sf.auto.search``, `sbpflow.auto.pipeline_search.search`, also tries pipeline stages).

    ``memory_limit`` in bytes per device (default: ``cluster.memory_per_device`` if it has
    one; pass ``float('inf')`` for none). ``zero`` / ``recompute``: each layer's ZeRO-
    sharded / recomputing twins in the space. ``in_flight``, ``shared``: `Problem`. Options:
    ``restarts``, ``window`` (cd; 1 turns the joint moves off), ``iterations``, ``beta``
    (mh), ``samples`` (random), ``start`` (a list of candidate indices or a Strategy: where
    cd and mh start; for exhaustive a bound that prunes, the result unchanged). Bad input
    (a graph with a size below 1, an unknown algorithm, a negative budget, micro-batches
    below 1) raises `SearchInputError` naming it (`checks.check_search`)."""
    check_search(graph, algorithm, ALGORITHMS, budget_s, micro_batches)
    check_memory_limit(memory_limit)
    if memory_limit is None:
        memory_limit = getattr(cluster, "memory_per_device", None)
    if memory_limit is not None and math.isinf(memory_limit):
        memory_limit = None
    if micro_batches == "auto":
        m, last = 1, None
        limit_m = min(l.input_shape[0] for l in graph.layers)
        while m <= limit_m and whole_sequences(graph, m):
            last = one_stage_search(graph, cluster, algorithm, seed, budget_s=budget_s,
                                    memory_limit=memory_limit, micro_batches=m,
                                    max_dims=max_dims, zero=zero, in_flight=in_flight,
                                    shared=None, recompute=recompute, **options)
            if last.fits:
                return last
            m *= 2
        return last
    check_whole_sequences(graph, micro_batches)
    pb = Problem(graph, cluster, memory_limit=memory_limit, micro_batches=micro_batches,
                 max_dims=max_dims, zero=zero, in_flight=in_flight, shared=shared,
                 recompute=recompute)
    start = options.pop("start", None)
    if isinstance(start, Strategy):
        start = [_start_index(pb.cands[i], s) for i, s in enumerate(start.layers)]
    if start is not None and algorithm in ("cd", "mh", "exhaustive"):
        options["start"] = start
    rng = random.Random(seed)
    t0 = time.perf_counter()
    trace: list = []
    state, cost = ALGORITHMS[algorithm](pb, rng, budget_s=budget_s, t0=t0, trace=trace,
                                        **options)
    seconds = time.perf_counter() - t0
    strategy = pb.strategy(state)
    return SearchResult(strategy, pb.ev.breakdown(strategy), trace=trace, algorithm=algorithm,
                        cost=float(cost), seconds=seconds, evaluations=pb.evaluations,
                        micro_batches=int(micro_batches), memory_limit=memory_limit,
                        edge_evaluations=pb.edge_evaluations)
