"""Cost of a strategy: alpha-beta time of every redistribution, weight-gradient sync, compute,
and memory per device (`Breakdown`), from per-layer and per-edge terms an `Evaluator` keeps.

Redistributions are priced analytically (`redistribution_price`, re-exported here with
`edge_lower_bounds` from `edge_bounds`). See docs/auto.md, 'Evaluation'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..caches import memoize
from ..layouts import MeshLayout, from_quartet
from ..sbp import Partial, S, Split, dual_nd
from .edge_bounds import edge_lower_bounds
from .redistribution_price import (redistribution, redistribution_floor, redistribution_steps,
                                   find_walk, transfer_floor, walk_price)
from .space import _clip_axis
from .transfer_loads import find_fractions

__all__ = ["Breakdown", "Evaluator", "evaluate", "redistribution", "redistribution_steps",
           "redistribution_floor", "edge_lower_bounds"]


# ---- per-layer and per-edge terms --------------------------------------------------------------
def _local_numel(shape, mesh, nd):
    n = math.prod(shape)
    for s, m in zip(nd, mesh):
        if isinstance(s, Split):
            n /= m
    return n


def _work_split(s) -> int:
    """How many ways a layer's work is divided under strategy ``s``: the product of the mesh
    dims that split one of its operands (input, weight or output). On the other dims every
    device does the dim's whole work: replicated (``rep``), or a partial input kept unreduced
    (``pin``: each device multiplies a whole-size partial sum). (A vocabulary-split embedding
    counts as divided: its lookups are a negligible part of any model's work.)"""
    n, inp, out, w = 1, s.input, s.output, s.weight
    for d, size in enumerate(s.mesh):   # (plain tests: every candidate of every layer asks)
        if isinstance(inp[d], Split) or isinstance(out[d], Split) or \
                (w is not None and isinstance(w[d], Split)):
            n *= size
    return n


@dataclass
class Breakdown:
    """Predicted cost of one strategy (times in seconds, bytes per device)."""

    time: float = 0.0
    compute_time: float = 0.0
    forward_time: float = 0.0      # activation redistributions, forward
    backward_time: float = 0.0     # activation-gradient redistributions, backward
    grad_sync_time: float = 0.0    # weight-gradient sync (and ZeRO weight gathers)
    gather_time: float = 0.0       # of which ZeRO weight gathers (every micro-batch)
    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    grad_sync_bytes: float = 0.0
    memory: dict = field(default_factory=dict)   # params, grads, optimizer, activations, total
    per_layer: dict = field(default_factory=dict)  # name -> time, compute, bytes, memory
    micro_batches: int = 1
    # pipelines (`sbpflow.auto.pipeline_cost`): per stage its time per micro-batch and memory per
    # device; the stage-to-stage transfers on the critical path; the bubble's share of time
    stages: int = 1
    schedule: str = ""
    stage_times: list = field(default_factory=list)
    stage_memory: list = field(default_factory=list)
    transfer_time: float = 0.0
    bubble_time: float = 0.0

    @property
    def comm_time(self) -> float:
        """Predicted communication seconds of a step: forward + backward + gradient
        synchronisation."""
        return self.forward_time + self.backward_time + self.grad_sync_time

    @property
    def bytes(self) -> float:
        """Bytes a device sends in a step: forward + backward + gradient synchronisation."""
        return self.forward_bytes + self.backward_bytes + self.grad_sync_bytes

    def __str__(self) -> str:
        gb = 1 << 30
        m = self.memory
        return (f"time {self.time * 1e3:.3f} ms (compute {self.compute_time * 1e3:.3f}, comm "
                f"{self.comm_time * 1e3:.3f}: fwd {self.forward_time * 1e3:.3f}, bwd "
                f"{self.backward_time * 1e3:.3f}, grad sync {self.grad_sync_time * 1e3:.3f})\n"
                f"bytes/device: fwd {self.forward_bytes / 1e6:.2f} MB, bwd "
                f"{self.backward_bytes / 1e6:.2f} MB, grad sync {self.grad_sync_bytes / 1e6:.2f} MB\n"
                f"memory/device: params {m.get('params', 0) / gb:.2f} GiB, grads "
                f"{m.get('grads', 0) / gb:.2f}, optimizer {m.get('optimizer', 0) / gb:.2f}, "
                f"activations {m.get('activations', 0) / gb:.2f}, total "
                f"{m.get('total', 0) / gb:.2f} GiB (micro-batches {self.micro_batches})"
                + self._pipeline_line())

    def _pipeline_line(self) -> str:
        if self.stages <= 1:
            return ""
        gb = 1 << 30
        return (f"\npipeline: {self.stages} stages, {self.micro_batches} micro-batches "
                f"{self.schedule}; per micro-batch (ms) "
                + " ".join(f"{t * 1e3:.3f}" for t in self.stage_times)
                + f"; bubble {self.bubble_time * 1e3:.3f} ms, transfers "
                f"{self.transfer_time * 1e3:.3f} ms; memory/device per stage (GiB) "
                + " ".join(f"{m / gb:.2f}" for m in self.stage_memory))


def _no_backward(a_out: tuple, b_in: tuple) -> bool:
    """An edge has no backward redistribution after a partial other than a sum (its gradient
    is not a redistribution: `sbpflow.sbp.dual_nd`)."""
    return any(isinstance(x, Partial) and x.op != "sum" for x in b_in + a_out)


@memoize(1 << 17)
def _gradient_sbps(a_out: tuple, b_in: tuple) -> tuple | None:
    """``(dual(b_in), dual(a_out))`` (`MeshLayout.dual`'s rule, `sbpflow.sbp.dual_nd`), or
    None when the edge has no backward redistribution (`_no_backward`)."""
    return None if _no_backward(a_out, b_in) else (dual_nd(b_in), dual_nd(a_out))


def _gradient_layouts(src, dst) -> tuple | None:
    """``(dst.dual(), src.dual())``: the layouts the gradient of an edge ``src -> dst``
    moves from and to, or None (`_gradient_sbps`); asked for at every backward floor, price
    and batch of loads. They are ``(mesh, nd-sbp)`` tuples, equal to those MeshLayouts: a
    MeshLayout takes ~0.5 us to build, a tuple 0.06; and a memo keyed by the layouts (not by
    their nd-sbps alone) held 68k entries instead of 1.9k after GPT-3's exhaustive search,
    400k more objects (2.33M) for each garbage collection to walk: +8 % CPU in
    benchmarks/auto_search.py --quick."""
    grad = _gradient_sbps(src[1], dst[1])
    return None if grad is None else ((dst[0], grad[0]), (src[0], grad[1]))


def _price_key(shape, src, dst, micro) -> tuple:
    """The key of `Evaluator._redist`'s memo (`Evaluator.find_loads` reads it too): flat,
    ``(shape, src mesh, src nd-sbp, dst mesh, dst nd-sbp, micro)``, so an entry keeps no
    layout object alive that its asker built (the node terms build theirs per candidate)."""
    return (shape, *src, *dst, micro)


# prices an evaluator keeps (`Evaluator._redist`): a GPT-3 stage's exhaustive search asks
# for about 200k distinct ones, a few hundred bytes each
_PRICES_KEPT = 1 << 19


class Evaluator:
    """Per-layer and per-edge cost terms for one (graph, cluster), cached. The cost of a
    strategy is the sum of ``node`` over layers and ``edge`` over the graph's edges."""

    def __init__(self, graph, cluster, micro_batches: int = 1, shared: dict | None = None):
        """``shared``: the caches' dicts, shared by evaluators of graphs cut from one model
        (a pipeline's stages) on the same cluster and micro-batch count (the caches are
        keyed by layer keys and layouts, not by layer names)."""
        self.graph, self.cluster, self.micro = graph, cluster, int(micro_batches)
        self.itemsize = graph.itemsize
        shared = {} if shared is None else shared
        self._node: dict = shared.setdefault("node", {})
        self._mem: dict = shared.setdefault("memory", {})
        self._edge: dict = shared.setdefault("edge", {})
        self._prices: dict = shared.setdefault("prices", {})
        # prices and transfer floors by (`Walk`, shape[, micro]): the walk holds its layouts
        self._walk_prices: dict = shared.setdefault("walk_prices", {})
        self._floors: dict = shared.setdefault("floors", {})
        # the transfer walks whose loads `find_loads` found (a cleared loads memo is only
        # slower: a price then finds what it reads itself)
        self._loaded: set = shared.setdefault("loaded", set())

    def _redist(self, shape, src: MeshLayout, dst: MeshLayout, micro=1, *old):
        """`redistribution` ``(seconds, bytes)`` on this cluster, memoised: a layer's
        candidates share few weight and output layouts (GPT-3: 28,663 gradient syncs asked
        for in a default search, 9,627 distinct), and an edge direction the search bounded
        by its walk (`edge_forward_floor`) is asked for again when the entry is priced. The
        old form ``(shape, a_mesh, a, b_mesh, b[, micro])`` works one release (`from_quartet`,
        read from ``*old``: the empty tuple costs the hot path nothing)."""
        if old:
            src, dst, rest = from_quartet("Evaluator._redist", src, dst, (micro,) + old)
            micro = rest[0] if rest else 1
        key = _price_key(shape, src, dst, micro)
        hit = self._prices.get(key)
        if hit is None:
            if len(self._prices) >= _PRICES_KEPT:
                for memo in (self._prices, self._walk_prices, self._floors, self._loaded):
                    memo.clear()
            # layout pairs whose meshes refine to one walk share its price (VGG-13: 40 % of
            # the prices a search asks for)
            walk = find_walk(len(shape), *src, *dst)
            wkey = (walk, shape, micro)
            hit = self._walk_prices.get(wkey)
            if hit is None:
                hit = self._walk_prices[wkey] = walk_price(walk, tuple(shape), self.itemsize,
                                                           self.cluster, micro)
            self._prices[key] = hit
        return hit

    def find_loads(self, shape: tuple, pairs: list, forward: list, backward: bool) -> None:
        """Before the edge entries ``pairs`` (``(src, dst)`` MeshLayouts each, of a tensor of
        ``shape``) are priced: the transfer loads their prices will read, found in
        one batch (`find_fractions`), a numpy pass for all instead of one each; the forward
        direction where ``forward[k]``, the backward with ``backward``, directions already
        priced left out. The prices that follow read them from the memo, unchanged."""
        walks, micro, prices, loaded = [], self.micro, self._prices, self._loaded
        for (a, b), fwd in zip(pairs, forward):
            if fwd and _price_key(shape, a, b, micro) not in prices:
                walks.append(find_walk(len(shape), *a, *b))
            grad = _gradient_layouts(a, b) if backward else None
            if grad is not None and _price_key(shape, *grad, micro) not in prices:
                walks.append(find_walk(len(shape), *grad[0], *grad[1]))
        # a walk's loads are found once (for any shape: they are fractions of the tensor)
        walks = [w for w in dict.fromkeys(walks) if w.how == "transfer" and w not in loaded]
        find_fractions([k for w in walks for k in w.body.keys])
        loaded.update(walks)

    def node_memory(self, layer, s) -> dict:
        """Memory per device of one layer (bytes): ``params``, ``grads``, ``optimizer``,
        ``activations`` (per micro-batch in flight) and their ``total``; no pricing."""
        key = (layer.key, s)
        hit = self._mem.get(key)
        if hit is not None:
            return hit
        mesh, it = s.mesh, self.itemsize
        g = self.graph
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        if layer.weight_shape is not None:
            ws = tuple(layer.weight_shape)
            if s.zero in (1, 2):   # docs/auto.md, 'ZeRO stages': the weight kept whole
                whole, split = _local_numel(ws, mesh, s.weight), _local_numel(ws, mesh, s.stored)
                mem["params"] = whole * it
                mem["grads"] = (split if s.zero == 2 else whole) * it
                mem["optimizer"] = split * g.optimizer_itemsize * g.optimizer_states
            else:
                n = _local_numel(ws, mesh, s.weight_stored)
                mem["params"] = mem["grads"] = n * it
                mem["optimizer"] = n * g.optimizer_itemsize * g.optimizer_states
        # saved for backward: the input and the output (a recomputed layer only its input)
        saved = _local_numel(layer.input_shape, mesh, s.input)
        if not getattr(s, "recompute", False):
            saved += _local_numel(layer.output_shape, mesh, s.output)
        mem["activations"] = saved * it / self.micro
        mem["total"] = sum(mem.values())
        self._mem[key] = mem
        return mem

    def node_terms(self, layer, s) -> dict:
        """compute, grad-sync (time, bytes), sink reduction (fwd/bwd), memory of one layer."""
        idx = self.graph.index.get(layer.name)
        sink = idx is not None and not self.graph.succs[idx]
        key = (layer.key, s, sink)
        hit = self._node.get(key)
        if hit is not None:
            return hit
        mesh, m = s.mesh, self.micro
        # forward + backward (2x forward); recomputation runs the forward once more
        passes = 4.0 if getattr(s, "recompute", False) else 3.0
        compute = passes * layer.flops / _work_split(s) / self.cluster.device_flops
        gt = gb = gather = 0.0
        if layer.weight_shape is not None and s.zero in (1, 2):
            gt, gb = self._zero12(layer, s)
        elif layer.weight_shape is not None:
            w, st = MeshLayout(mesh, s.weight), MeshLayout(mesh, s.weight_stored)
            ws = tuple(layer.weight_shape)
            t, b = self._redist(ws, w.dual(), st)   # gradient -> param layout
            gt, gb = gt + t, gb + b
            if st != w:  # ZeRO-3: gather the weight for forward and again for backward
                t, b = self._redist(ws, st, w)
                gt, gb, gather = gt + 2 * m * t, gb + 2 * m * b, 2 * m * t
        ft, fb, bt, bb = self._sink_terms(layer, s) if sink else (0.0, 0.0, 0.0, 0.0)
        out = {"compute": compute, "grad_time": gt, "grad_bytes": gb, "fwd_time": ft,
               "fwd_bytes": fb, "bwd_time": bt, "bwd_bytes": bb,
               "memory": self.node_memory(layer, s), "gather_time": gather,
               "time": compute + gt + ft + bt}
        self._node[key] = out
        return out

    def _sink_terms(self, layer, s) -> tuple:
        """(fwd time, bytes, bwd time, bytes) of a sink layer: the loss needs a full value,
        so a partial output is reduced (and its gradient sent back the dual way)."""
        if not any(isinstance(x, Partial) for x in s.output):
            return 0.0, 0.0, 0.0, 0.0
        m, out = self.micro, s.output_layout
        red = MeshLayout(s.mesh, tuple(S(0) if isinstance(x, Partial) else x for x in s.output))
        shape = tuple(layer.output_shape)
        ft, fb = self._redist(shape, out, red, m)
        bt, bb = self._redist(shape, red.dual(), out.dual(), m)
        return ft, fb, bt, bb

    def _zero12(self, layer, s) -> tuple:
        """(grad-sync time, bytes) of a weight at ZeRO stage 1 or 2 (docs/auto.md, 'ZeRO
        stages'): the gradient reduce-scattered to ``stored`` and the updated shard
        all-gathered back, once a step (data parallelism's bytes)."""
        w, st, ws = MeshLayout(s.mesh, s.weight), MeshLayout(s.mesh, s.stored), \
            tuple(layer.weight_shape)
        t1, b1 = self._redist(ws, w.dual(), st)
        t2, b2 = self._redist(ws, st, w)
        return t1 + t2, b1 + b2

    def edge_terms(self, producer, a, consumer, b) -> dict:
        """Forward redistribution of the producer's output into the consumer's input layout
        and the dual redistribution of its gradient in backward."""
        shape = tuple(producer.output_shape)
        b_in = _clip_axis(b.input, len(shape))
        key = (shape, a.mesh, a.output, b.mesh, b_in)   # flat: as `_price_key`
        hit = self._edge.get(key)
        if hit is not None:
            return hit
        ft, fb, bt, bb = self._edge_pair(shape, a.output_layout, MeshLayout(b.mesh, b_in))
        out = {"fwd_time": ft, "fwd_bytes": fb, "bwd_time": bt, "bwd_bytes": bb,
               "time": ft + bt}
        self._edge[key] = out
        return out

    # The edge methods below take the producer's output layout ``src`` and the consumer's
    # input layout ``dst`` (clipped to the tensor's axes), `MeshLayout` s or (mesh, nd-sbp)
    # pairs; the old form (shape, a_mesh, a_out, b_mesh, b_in) works one release
    # (`from_quartet`: a DeprecationWarning). The search calls them once per table entry, so
    # the old form is read from ``*old`` (an empty tuple costs nothing), not by a decorator.
    def edge_time(self, shape: tuple, src: MeshLayout, dst: MeshLayout, *old) -> float:
        """``edge_terms(...)["time"]`` from the layouts alone, not cached here: the search's
        edge tables are the cache."""
        if old:
            src, dst, _ = from_quartet("Evaluator.edge_time", src, dst, old)
        ft, _, bt, _ = self._edge_pair(shape, src, dst)
        return ft + bt

    def edge_forward(self, shape: tuple, src: MeshLayout, dst: MeshLayout, *old) -> float:
        """The forward part of `edge_time` (its first term)."""
        if old:
            src, dst, _ = from_quartet("Evaluator.edge_forward", src, dst, old)
        return self._redist(shape, src, dst, self.micro)[0]

    def edge_backward(self, shape: tuple, src: MeshLayout, dst: MeshLayout, *old) -> float:
        """The backward part of `edge_time` (its second term)."""
        if old:
            src, dst, _ = from_quartet("Evaluator.edge_backward", src, dst, old)
        return self._edge_backward(shape, src, dst)[0]

    def _edge_backward(self, shape, src, dst):
        """(seconds, bytes) of the gradient's dual redistribution (`_no_backward`: none)."""
        grad = _gradient_layouts(src, dst)
        if grad is None:
            return 0.0, 0.0
        return self._redist(shape, grad[0], grad[1], self.micro)

    def edge_forward_floor(self, shape: tuple, src: MeshLayout, dst: MeshLayout,
                           *old) -> tuple[float, bool]:
        """``(seconds, exact)``: `edge_forward` when its walk is the fixed order's moves (cheap
        to price once the walk is known), else `redistribution_floor`'s lower bound of it
        (a transfer's loads not found)."""
        if old:
            src, dst, _ = from_quartet("Evaluator.edge_forward_floor", src, dst, old)
        return self._floor(shape, src, dst)

    def edge_backward_floor(self, shape: tuple, src: MeshLayout, dst: MeshLayout,
                            *old) -> tuple[float, bool]:
        """`edge_backward` or a lower bound of it, as `edge_forward_floor`."""
        if old:
            src, dst, _ = from_quartet("Evaluator.edge_backward_floor", src, dst, old)
        grad = _gradient_layouts(src, dst)
        if grad is None:
            return 0.0, True
        return self._floor(shape, grad[0], grad[1])

    def _floor(self, shape, src: MeshLayout, dst: MeshLayout, *old) -> tuple[float, bool]:
        """`redistribution_floor`, kept by walk and shape (`Walk`), or the price when the
        walk is the fixed order's moves (exact: True). The old form as `_redist`'s."""
        if old:
            src, dst, _ = from_quartet("Evaluator._floor", src, dst, old)
        walk = find_walk(len(shape), *src, *dst)
        if walk.how != "transfer":
            return self._redist(shape, src, dst, self.micro)[0], True
        key = (walk, shape)
        floor = self._floors.get(key)
        if floor is None:
            if len(self._floors) >= _PRICES_KEPT:
                self._floors.clear()
            floor = self._floors[key] = transfer_floor(walk.body, shape, self.itemsize,
                                                       self.cluster, self.micro)
        return floor, False

    def _edge_pair(self, shape, src, dst):
        ft, fb = self._redist(shape, src, dst, self.micro)
        bt, bb = self._edge_backward(shape, src, dst)
        return ft, fb, bt, bb

    def breakdown(self, strategy) -> Breakdown:
        """The priced `Breakdown` of ``strategy`` (a `Strategy` or a sequence of
        `LayerStrategy`, one a layer): times, bytes and memory per device."""
        g = self.graph
        layers = strategy.layers if hasattr(strategy, "layers") else list(strategy)
        r = Breakdown(micro_batches=self.micro)
        mem = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "activations": 0.0}
        for layer, s in zip(g.layers, layers):
            n = self.node_terms(layer, s)
            r.compute_time += n["compute"]
            r.grad_sync_time += n["grad_time"]
            r.gather_time += n["gather_time"]
            r.grad_sync_bytes += n["grad_bytes"]
            r.forward_time += n["fwd_time"]
            r.forward_bytes += n["fwd_bytes"]
            r.backward_time += n["bwd_time"]
            r.backward_bytes += n["bwd_bytes"]
            for k in mem:
                mem[k] += n["memory"][k]
            r.per_layer[layer.name] = {"time": n["time"], "compute": n["compute"],
                                       "bytes": n["grad_bytes"] + n["fwd_bytes"] +
                                       n["bwd_bytes"], "memory": n["memory"]["total"]}
        for u, v in g.edges:
            e = self.edge_terms(g.layers[u], layers[u], g.layers[v], layers[v])
            r.forward_time += e["fwd_time"]
            r.forward_bytes += e["fwd_bytes"]
            r.backward_time += e["bwd_time"]
            r.backward_bytes += e["bwd_bytes"]
            pl = r.per_layer[g.layers[v].name]   # an edge is charged to its consumer
            pl["time"] += e["time"]
            pl["bytes"] += e["fwd_bytes"] + e["bwd_bytes"]
        mem["total"] = sum(mem.values())
        r.memory = mem
        r.time = (r.compute_time + r.forward_time + r.backward_time + r.grad_sync_time)
        return r


def evaluate(graph, strategy, cluster, micro_batches: int = 1) -> Breakdown:
    """The predicted time, bytes per device and memory per device of a one-stage
    ``strategy`` (`sbpflow.auto.pipeline_cost.evaluate`, which ``sf.auto.evaluate`` is, also takes
    pipelines)."""
    return Evaluator(graph, cluster, micro_batches).breakdown(strategy)
