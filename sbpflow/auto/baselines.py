"""Expert strategies as points of the space: data parallel, Megatron tensor x pipeline x data,
and the Megatron-LM paper's Table 1 (its GPT configurations and measured throughput).

See docs/auto.md, 'Against Megatron-LM'.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import NamedTuple

from ..cost.cluster import Cluster
from . import model_graphs
from .evaluate import evaluate
from .pipeline_cost import balanced_cuts, sub_cluster
from .pipeline_cost import evaluate as evaluate_any
from .space import PipelineShape, Strategy, check_whole_sequences, make_layer_strategy

__all__ = ["data_parallel", "megatron", "megatron_pipeline", "megatron_layers",
           "best_megatron", "megatron_stages", "megatron_flops", "block_layers",
           "full_recompute",
           "MegatronRow", "TABLE1", "MegatronCase", "table1_case"]


def _build(graph, mesh, roles, layers=None):
    out: list = []
    memo: dict = {}     # a layer's strategy depends only on its key (roles read its attrs)
    for layer in (graph.layers if layers is None else layers):
        if layer.key in memo:
            out.append(memo[layer.key])
            continue
        names = tuple(roles(layer))
        s = make_layer_strategy(layer, mesh, names)
        for i in range(len(names)):   # e.g. more data-parallel ranks than sequences: replicate
            if s is None:
                names = names[:i] + ("rep",) + names[i + 1:]
                s = make_layer_strategy(layer, mesh, names)
        if s is None:
            raise ValueError(f"layer {layer.name}: {names} does not fit mesh {mesh}")
        memo[layer.key] = s
        out.append(s)
    return out if layers is not None else Strategy(graph, out)


def data_parallel(graph, cluster) -> Strategy:
    """Every layer splits its batch over all devices; weights replicated (all-reduced)."""
    return _build(graph, (cluster.world_size,), lambda l: ("dp",))


def _tensor_data(graph, tp: int, dp: int, layers=None):
    """Megatron's layout of ``layers`` on ``tp * dp`` devices: mesh (dp, tp), data parallel
    across dim 0 (outer: across nodes), each layer's Megatron role inside dim 1 (column / row
    linears, attention heads, vocabulary-parallel embedding and head, conv out-channels)."""
    if tp == 1:
        return _build(graph, (dp,), lambda l: ("dp",), layers)
    if dp == 1:
        return _build(graph, (tp,), lambda l: (l.attrs.get("megatron", "col"),), layers)
    return _build(graph, (dp, tp), lambda l: ("dp", l.attrs.get("megatron", "col")), layers)


def megatron_layers(graph, tp: int, dp: int) -> list:
    """Megatron's layout of every layer of ``graph`` on one mesh (dp, tp) of ``tp * dp``
    devices (`megatron`'s, without stages), a LayerStrategy a layer; ValueError when a
    layer has none."""
    return _tensor_data(graph, tp, dp, list(graph.layers))


def _key_counts(graph) -> collections.Counter:
    """How often each layer key (shapes and kind) occurs in ``graph``: a block repeats its."""
    return collections.Counter(l.key for l in graph.layers)


def block_layers(graph) -> list:
    """Indices of the layers of ``graph``'s repeated blocks: those whose key occurs as often as
    the most repeated key, when that is more than once (a GPT's transformer-block layers: not
    its embedding or head)."""
    counts = _key_counts(graph)
    most = max(counts.values(), default=0)
    return [i for i, l in enumerate(graph.layers) if most > 1 and counts[l.key] == most]


def full_recompute(strategy: Strategy) -> Strategy:
    """``strategy`` with Megatron-LM's full activation recomputation: every layer of a repeated
    block (`block_layers`) keeps only its input for backward and runs its forward again there
    (``LayerStrategy.recompute``); the other layers as they were."""
    blocks = set(block_layers(strategy.graph))
    layers = [dataclasses.replace(s, recompute=True) if i in blocks else s
              for i, s in enumerate(strategy.layers)]
    return Strategy(strategy.graph, layers, strategy.pipeline)


def megatron_stages(graph, pp: int) -> list:
    """Where Megatron's ``pp`` stages start: equal numbers of the most repeated layer (a GPT's
    transformer blocks) a stage, the embedding in the first and the head in the last; when the
    count does not divide by ``pp``, cut before those layers balancing forward flops."""
    counts = _key_counts(graph)
    key = max(counts, key=counts.get)
    starts = [i for i, l in enumerate(graph.layers) if l.key == key and i > 0]
    n = counts[key]
    if n % pp == 0 and len(starts) == n:
        return [0] + [starts[k * n // pp] for k in range(1, pp)]
    got = balanced_cuts([l.flops for l in graph.layers], pp,
                        starts if len(starts) >= pp - 1 else list(range(1, len(graph.layers))))
    if got is None:
        raise ValueError(f"{graph.name}: {len(graph.layers)} layers cannot be cut into {pp} "
                         "pipeline stages; use fewer stages")
    return got


def _check(graph, p: int, tp: int, pp: int, dp: int, micro_batches: int) -> None:
    if min(tp, pp, dp, micro_batches) < 1 or tp * pp * dp != p:
        raise ValueError(f"Megatron tp {tp} x pp {pp} x dp {dp} != the cluster's {p} devices; "
                         f"choose sizes whose product is {p}")
    for l in graph.layers:
        heads = l.attrs.get("heads") if l.kind == "attention" else None
        if heads is not None and heads % tp:
            raise ValueError(f"layer {l.name}: tensor parallel size {tp} does not divide its "
                             f"{heads} heads; choose tp dividing {heads}")
    if pp > 1 and not graph.is_chain:
        raise ValueError(f"{graph.name}: pipeline stages (pp {pp}) need a chain of layers")


def megatron(graph, cluster, tp: int, pp: int = 1, dp: int | None = None,
             micro_batches: int = 1, recompute: bool = False) -> Strategy:
    """Megatron-LM's configuration tensor ``tp`` x pipeline ``pp`` x data ``dp`` (default: the
    rest of the devices) as a Strategy. ``pp > 1``: the chain cut into ``pp`` stages
    (`megatron_stages`) of ``tp * dp`` consecutive ranks each, ``micro_batches`` a step run
    1F1B (the strategy's `PipelineShape`). ``pp == 1``: one stage; ``micro_batches`` is then
    gradient accumulation, which a Strategy does not carry: evaluate with
    ``evaluate(graph, s, cluster, micro_batches)``. ``recompute``: Megatron's full activation
    recomputation of every transformer block (`full_recompute`), as the paper's runs used.
    ValueError when tp x pp x dp is not the
    device count, tp does not divide the heads, or the stages do not tile whole nodes (or
    equal parts of one)."""
    p = cluster.world_size
    if dp is None:
        if min(tp, pp) < 1 or p % (tp * pp):
            raise ValueError(f"Megatron tp {tp} x pp {pp} does not divide the cluster's {p} "
                             f"devices (dp is the rest); choose tp x pp dividing {p}")
        dp = p // (tp * pp)
    _check(graph, p, tp, pp, dp, micro_batches)
    check_whole_sequences(graph, micro_batches)
    if pp == 1:
        s = _tensor_data(graph, tp, dp)
    elif sub_cluster(cluster, tp * dp) is None:
        raise ValueError(f"{pp} stages of {tp * dp} devices do not tile {cluster} by whole "
                         "nodes or equal parts of a node")
    else:
        s = megatron_pipeline(graph, tp, dp, megatron_stages(graph, pp), micro_batches)
    return full_recompute(s) if recompute else s


def megatron_pipeline(graph, tp: int, dp: int, starts: list, micro_batches: int,
                      schedule: str = "1f1b") -> Strategy:
    """Megatron's tensor ``tp`` x data ``dp`` layout (`megatron`'s) on each stage of a chain
    cut before the layers ``starts`` (``starts[0] == 0``), ``micro_batches`` a step. No
    check of the device count (the caller's); ValueError when a layer has no such layout
    (e.g. tp does not divide its heads)."""
    ends = list(starts[1:]) + [len(graph.layers)]
    layers = []
    for k, (a, b) in enumerate(zip(starts, ends)):
        part = _tensor_data(graph, tp, dp, graph.layers[a:b])
        layers += [dataclasses.replace(s, stage=k) for s in part]
    return Strategy(graph, layers, PipelineShape(len(starts), tp * dp, micro_batches, schedule))


def best_megatron(graph, cluster, memory_limit: float | None = None):
    """The best Megatron t x d (least predicted time) under the memory limit; returns
    (strategy, breakdown, tp) or None if no t x d fits."""
    if memory_limit is None:
        memory_limit = getattr(cluster, "memory_per_device", None)
    p, best = cluster.world_size, None
    for tp in range(1, p + 1):
        if p % tp:
            continue
        try:
            s = megatron(graph, cluster, tp)
        except ValueError:
            continue
        b = evaluate(graph, s, cluster)
        if memory_limit is not None and not math.isinf(memory_limit) and \
                b.memory["total"] > memory_limit:
            continue
        if best is None or b.time < best[1].time:
            best = (s, b, tp)
    return best


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one training step of a GPT as the Megatron-LM paper counts them (Narayanan et
    al., SC'21, section 5.1): ``96 B s l h^2 (1 + s / 6h + V / 16lh)``, forward, backward and
    the forward recomputed by activation checkpointing (4 forward passes of the matmuls)."""
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    return 96.0 * b * s * l * h * h * (1 + s / (6.0 * h) + v / (16.0 * l * h))


class MegatronRow(NamedTuple):
    """One row of Table 1 of the Megatron-LM paper: a GPT (``params_b`` billion parameters,
    sequence 2048, vocabulary 51200) and the configuration and per-GPU throughput measured."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float     # achieved teraFLOP/s per GPU (the paper's FLOP count, `megatron_flops`)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC'21, Table 1 (weak scaling on Selene, DGX A100 80 GB nodes).
TABLE1 = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


class MegatronCase(NamedTuple):
    """A Table 1 row made concrete: its GPT graph, the cluster, Megatron's strategy and its
    micro-batch count (one sequence a micro-batch), the predicted breakdown and the per-GPU
    TFLOP/s it gives by the paper's FLOP count."""

    graph: object
    cluster: Cluster
    strategy: Strategy
    micro_batches: int
    breakdown: object
    tflops: float


def table1_case(row: MegatronRow, preset: str = "dgx-a100", seq: int = 2048,
                vocab: int = 51200, recompute: bool = True,
                **cluster_overrides) -> MegatronCase:
    """Row ``row`` of `TABLE1` on ``row.gpus / 8`` nodes of ``preset``: the GPT graph, Megatron's
    configuration with one sequence a micro-batch (Table 1 does not give the micro-batch size)
    and, as the paper's runs had (its FLOP count includes it), full activation recomputation
    of every transformer block (``recompute=False``: none), evaluated; its predicted TFLOP/s a
    GPU is `megatron_flops` over the step time."""
    g = model_graphs.gpt(row.layers, row.hidden, row.heads, seq, row.batch, vocab)
    c = Cluster.preset(preset, nodes=row.gpus // 8, **cluster_overrides)
    m = row.batch // row.dp
    s = megatron(g, c, row.tp, row.pp, row.dp, m, recompute=recompute)
    b = evaluate_any(g, s, c, m if row.pp == 1 else 1)
    tf = megatron_flops(row.batch, seq, row.layers, row.hidden, vocab) / b.time / row.gpus
    return MegatronCase(g, c, s, m, b, tf / 1e12)
