"""Automatic parallelism (AutoDDL): a graph of layers with shapes, a per-layer strategy space
(data / Megatron / 2-D / 2.5-D / 3-D matmul, partial sums kept unreduced, conv and embedding
splits), an analytic alpha-beta cost with memory, and search (coordinate descent with restarts,
Metropolis-Hastings, random, exact dynamic programming).

    g = sf.auto.model_graphs.gpt(layers=24, d_model=1024, heads=16, seq=1024, batch=512,
                                 vocab=50257)
    c = sf.cost.Cluster.preset("dgx-a100", nodes=2)
    r = sf.auto.search(g, c, algorithm="cd", seed=0)
    print(r.strategy); print(r.breakdown)
"""

from . import baselines, model_graphs
from .checks import MemoryLimitWarning
from .evaluate import Breakdown, Evaluator, redistribution, redistribution_steps
from .graph import Graph, Layer
from .interop import search
from .pipeline_cost import evaluate
from .search import SearchResult
from .space import LayerStrategy, Pipeline, Strategy, layer_space, meshes, space

__all__ = ["baselines", "model_graphs", "MemoryLimitWarning", "Breakdown", "Evaluator",
           "evaluate", "redistribution", "redistribution_steps", "Graph", "Layer",
           "SearchResult", "search", "LayerStrategy", "Pipeline", "Strategy", "layer_space",
           "meshes", "space"]

from .parallelize import ParallelPlan, parallelize, single_mesh_search  # noqa: E402
from .trace import trace  # noqa: E402

__all__ += ["ParallelPlan", "parallelize", "single_mesh_search", "trace"]
