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

from ..layouts import MeshLayout
from . import baselines, model_graphs
from .checks import MemoryLimitWarning
from .evaluate import Breakdown, Evaluator, redistribution, redistribution_steps
from .layer_graph import LayerGraph, Layer
from .pipeline_search import search
from .pipeline_cost import evaluate
from .strategy_search import SearchResult
from .space import LayerStrategy, PipelineShape, Strategy, layer_space, meshes, space

__all__ = ["baselines", "model_graphs", "MemoryLimitWarning", "Breakdown", "Evaluator",
           "evaluate", "redistribution", "redistribution_steps", "LayerGraph", "Layer",
           "SearchResult", "search", "LayerStrategy", "PipelineShape", "Strategy", "layer_space",
           "meshes", "space", "MeshLayout"]

from .parallelize import ParallelPlan, parallelize, single_mesh_search  # noqa: E402
from .trace import trace  # noqa: E402

__all__ += ["ParallelPlan", "parallelize", "single_mesh_search", "trace"]

from ..utils import renamed  # noqa: E402

__getattr__ = renamed(__name__, {  # the old names, for one release
    "Graph": "LayerGraph", "Pipeline": "PipelineShape",
    "graph": "sbpflow.auto.layer_graph:", "interop": "sbpflow.auto.pipeline_search:"})
