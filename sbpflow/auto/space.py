"""The strategy space: per layer, a mesh (a factorisation of the devices) and an nd-sbp for its
input, weight and output.

Every layer kind has a few 1-D signatures (what one mesh dim does: ``dp``, ``col``, ``row``,
``rep``, ``pin`` for a linear); an N-D strategy is one 1-D signature per mesh dim, which gives
the 2-D and 2.5-D / 3-D matmul splits. Meshes are every ordered factorisation of the device
count. See docs/auto.md, 'The strategy space'.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from ..caches import BoundedDict, memoize
from ..errors import GraphError, ParallelizeError
from ..layouts import MeshLayout
from ..sbp import B, P, S, Split, format_nd_sbp
from ..utils import renamed

__all__ = ["LayerStrategy", "Strategy", "PipelineShape", "SIGNATURES", "meshes", "layer_space",
           "space", "make_layer_strategy", "whole_sequences", "check_whole_sequences",
           "splits_sequences", "weight_layout", "tie_agrees", "tie_agreement", "zero_stage",
           "zero_twin"]

_N = None  # no weight

SIGNATURES: dict[str, dict[str, tuple]] = {
    "linear": {"dp": (S(0), B, S(0)), "col": (B, S(1), S(1)), "row": (S(1), S(0), P),
               "rep": (B, B, B), "pin": (P, B, P)},
    "conv": {"dp": (S(0), B, S(0)), "outch": (B, S(0), S(1)), "inch": (S(1), S(1), P),
             "rep": (B, B, B), "pin": (P, B, P)},
    "embedding": {"dp": (S(0), B, S(0)), "vocab": (B, S(0), P), "dim": (B, S(1), S(1)),
                  "rep": (B, B, B)},
    "attention": {"dp": (S(0), _N, S(0)), "heads": (S(1), _N, S(1)), "rep": (B, _N, B)},
    "pool": {"dp": (S(0), _N, S(0)), "ch": (S(1), _N, S(1)), "rep": (B, _N, B)},
    "act": {"dp": (S(0), _N, S(0)), "ch": (S(1), _N, S(1)), "rep": (B, _N, B)},
    "interaction": {"dp": (S(0), _N, S(0)), "rep": (B, _N, B)},
}
_DP_NAME = "dp"


@dataclass(frozen=True)
class LayerStrategy:
    """One layer's parallelisation. ``weight`` is the layout the kernel uses (None for a
    weightless layer). ``stored`` (None: no ZeRO) is ZeRO's split layout along the weight's
    data-parallel dims, and ``zero`` the stage that keeps things in it (docs/auto.md, 'ZeRO
    stages'): 1 the optimizer state, 2 also the gradient, 3 (the default when ``stored`` is
    given) also the weight itself, all-gathered before use. ``zero`` is 0 without ``stored``;
    ``zero=0`` drops ``stored``."""

    mesh: tuple
    input: tuple
    weight: tuple | None
    output: tuple
    stored: tuple | None = None
    names: tuple = field(default=(), compare=False)
    stage: int = 0   # pipeline stage (0 without stages); mesh is then over its devices
    # activation recomputation: backward recomputes the layer's forward from its saved input
    # (the layer keeps only its input for backward, at the cost of one more forward)
    recompute: bool = False
    zero: int | None = None   # ZeRO stage (None: 3 with ``stored``, else 0)

    def __post_init__(self) -> None:
        z = self.zero
        if z is not None and (type(z) is not int or not 0 <= z <= 3):
            raise ParallelizeError(f"LayerStrategy: zero must be a ZeRO stage 0-3 (or None: 3 "
                                   f"with a stored layout), got {z!r}")
        if self.stored is None or z == 0:
            object.__setattr__(self, "stored", None)
            object.__setattr__(self, "zero", 0)
        elif z is None:
            object.__setattr__(self, "zero", 3)

    @property
    def devices(self) -> int:
        """Devices of the layer's mesh (the product of its sizes)."""
        return math.prod(self.mesh)

    @property
    def input_layout(self) -> MeshLayout:
        """The input's layout on the layer's mesh (prints as ``mesh(8, 4) (S(0), B)``)."""
        return MeshLayout(self.mesh, self.input)

    @property
    def output_layout(self) -> MeshLayout:
        """The output's layout on the layer's mesh."""
        return MeshLayout(self.mesh, self.output)

    @property
    def weight_stored(self) -> tuple | None:
        """Where the weight lives between steps: ``stored`` at stage 3, else ``weight``."""
        return self.stored if self.zero == 3 else self.weight

    @property
    def label(self) -> str:
        """A short name of the strategy (``dp:2 x col:4``, ``+zero`` when it stores weights
        split)."""
        if not self.names:
            return ""
        z = "" if not self.zero else " +zero" if self.zero == 3 else f" +zero{self.zero}"
        return " x ".join(f"{n}:{m}" for n, m in zip(self.names, self.mesh)) + z + (
            " +rc" if self.recompute else "")

    def __hash__(self) -> int:
        # the fields that compare, hashed once (a search hashes a strategy for every cached
        # node term it reads)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.mesh, self.input, self.weight, self.output, self.stored, self.stage,
                      self.recompute, self.zero))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __repr__(self) -> str:
        w = format_nd_sbp(self.weight) if self.weight is not None else "-"
        z = f", stored={format_nd_sbp(self.stored)}" if self.stored is not None else ""
        z += f", zero={self.zero}" if self.zero in (1, 2) else ""
        st = f", stage={self.stage}" if self.stage else ""
        rc = ", recompute=True" if self.recompute else ""
        return (f"LayerStrategy(mesh={self.mesh}, input={format_nd_sbp(self.input)}, weight={w}, "
                f"output={format_nd_sbp(self.output)}{z}{st}{rc})")


class PipelineShape(NamedTuple):
    """A strategy's pipeline: ``stages`` contiguous stages of the layer chain, each on
    ``devices`` consecutive ranks (stage k on ranks ``k * devices ..``), ``micro_batches``
    per step run by ``schedule`` (``"1f1b"`` or ``"gpipe"``)."""

    stages: int
    devices: int
    micro_batches: int
    schedule: str = "1f1b"

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage ``stage`` keeps at once: all of them in
        GPipe, ``stages - stage`` (at most all) in 1F1B."""
        if self.schedule == "gpipe":
            return self.micro_batches
        return min(self.micro_batches, self.stages - stage)


class Strategy:
    """Layer name -> LayerStrategy; indexable by name, prints as a table. ``pipeline`` (None:
    one stage on every device) says how the layers' ``stage`` s run (`PipelineShape`)."""

    def __init__(self, graph, layers: dict | list, pipeline: PipelineShape | None = None):
        self.graph = graph
        if isinstance(layers, dict):
            layers = [layers[l.name] for l in graph.layers]
        self.layers: list[LayerStrategy] = list(layers)
        self.pipeline = pipeline if pipeline is not None and pipeline.stages > 1 else None

    @property
    def stages(self) -> int:
        """Pipeline stages of the strategy (1 without a pipeline)."""
        return 1 if self.pipeline is None else self.pipeline.stages

    def __getitem__(self, name) -> LayerStrategy:
        return self.layers[name] if isinstance(name, int) else self.layers[self.graph.index[name]]

    def __iter__(self):
        return iter(l.name for l in self.graph.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def items(self):
        """``(layer name, LayerStrategy)`` pairs, in the graph's layer order."""
        return [(l.name, s) for l, s in zip(self.graph.layers, self.layers)]

    def __eq__(self, other) -> bool:
        return isinstance(other, Strategy) and self.layers == other.layers and \
            self.pipeline == other.pipeline

    def table(self, per_layer: dict | None = None) -> str:
        """One row per layer (with a stage column when there are stages); ``per_layer``
        (name -> extra text) adds a column. Columns widen to their longest entry."""
        st = self.pipeline is not None
        head = ("layer", "kind", "mesh", "signature", "input", "weight", "output")
        cells = []
        for layer, s in zip(self.graph.layers, self.layers):
            w = format_nd_sbp(s.weight_stored) if s.weight is not None else "-"
            cells.append((layer.name, layer.kind, str(s.mesh), s.label, format_nd_sbp(s.input),
                          w, format_nd_sbp(s.output)))
        widths = [max([least] + [len(c[i]) + 1 for c in cells])
                  for i, least in enumerate(_TABLE_WIDTHS)]
        rows = [("stage " if st else "") + "".join(f"{h:<{n}}" for h, n in zip(head, widths))]
        for layer, s, row in zip(self.graph.layers, self.layers, cells):
            text = (f"{s.stage:<6}" if st else "") + "".join(
                f"{c:<{n}}" for c, n in zip(row, widths))
            if per_layer:
                text += str(per_layer.get(layer.name, ""))
            rows.append(text.rstrip())
        return "\n".join(rows)

    __str__ = table

    def __repr__(self) -> str:
        pp = "" if self.pipeline is None else (
            f", {self.pipeline.stages} stages x {self.pipeline.devices} devices, "
            f"{self.pipeline.micro_batches} micro-batches {self.pipeline.schedule}")
        return f"Strategy({self.graph.name}, {len(self.layers)} layers{pp})\n{self.table()}"


_TABLE_WIDTHS = (14, 12, 16, 28, 22, 22, 22)  # `Strategy.table`'s least column widths


@memoize(1 << 12)
def meshes(p: int, max_dims: int = 3) -> tuple:
    """Every ordered factorisation of ``p`` into 1..max_dims factors >= 2 (``(1,)`` for p=1)."""
    if p == 1:
        return ((1,),)
    out = []

    def rec(rest, prefix):
        if rest == 1:
            out.append(tuple(prefix))
            return
        if len(prefix) == max_dims:
            return
        for f in range(2, rest + 1):
            if rest % f == 0:
                rec(rest // f, prefix + [f])
    rec(p, [])
    return tuple(sorted(out, key=lambda m: (len(m), m)))


def _splits(nd, mesh, ndim):
    """Product of the split factors per tensor axis."""
    f = [1] * ndim
    for s, m in zip(nd, mesh):
        if isinstance(s, Split):
            f[s.axis] *= m
    return f


def _fits(shape, nd, mesh) -> bool:
    return all(k <= n for k, n in zip(_splits(nd, mesh, len(shape)), shape))


def _clip_axis(nd, ndim):
    """``nd`` for a tensor of ``ndim`` axes: a split of an axis it lacks splits its last one
    (embedding ids (tokens,) have one axis: S(1) of the input means S(0) there; an edge's
    consumer layout read on its producer's output likewise)."""
    return tuple(S(ndim - 1) if isinstance(s, Split) and s.axis >= ndim else s for s in nd)


def whole_sequences(graph, micro_batches: int) -> bool:
    """Whether ``micro_batches`` micro-batches each hold whole sequences of every attention
    layer (its ``attrs["batch"]`` divisible by the count). Layers without a ``batch`` attr
    mix no samples, so any count suits them."""
    return all(l.attrs.get("batch", micro_batches) % micro_batches == 0
               for l in graph.layers if l.kind == "attention")


def check_whole_sequences(graph, micro_batches: int) -> None:
    """`GraphError` unless ``micro_batches`` is an int >= 1 whose micro-batches keep whole
    sequences (`whole_sequences`): what search, evaluate and the baselines accept."""
    if (not isinstance(micro_batches, numbers.Integral) or isinstance(micro_batches, bool)
            or micro_batches < 1):
        raise GraphError(f"{graph.name}: micro_batches must be an int >= 1, got "
                         f"{micro_batches!r}")
    if not whole_sequences(graph, micro_batches):
        batch = next(l.attrs.get("batch") for l in graph.layers if l.kind == "attention")
        raise GraphError(f"{graph.name}: {micro_batches} micro-batches would split the "
                         f"attention layers' sequences (batch {batch}); give a micro-batch "
                         f"count that divides the batch")


def _sequences(layer, micro_batches: int) -> int:
    """Sequences of one micro-batch an attention layer's axis-0 split must divide (0: the
    count does not divide the batch, so no split of it keeps whole sequences). Without a
    ``batch`` attr the batch is unknown: 1 (no split of axis 0) at any count."""
    if "batch" not in layer.attrs:
        return 1
    batch = layer.attrs["batch"]
    return batch // micro_batches if batch % micro_batches == 0 else 0


def splits_sequences(layer, s: LayerStrategy, micro_batches: int) -> bool:
    """Whether ``s`` gives a device part of a sequence of ``layer`` (an attention layer) when a
    step runs as ``micro_batches`` micro-batches: its batch split must divide each
    micro-batch's ``batch // micro_batches`` sequences."""
    if layer.kind != "attention":
        return False
    f = _splits(s.input, s.mesh, 2)[0]
    n = _sequences(layer, micro_batches)
    return n == 0 or n % f != 0


def zero_stage(zero) -> int:
    """``zero`` (a bool or a ZeRO stage 0-3) as a stage: True is 3, False 0; else
    `ParallelizeError`."""
    if zero is True or zero is False:
        return 3 if zero else 0
    if type(zero) is not int or not 0 <= zero <= 3:
        raise ParallelizeError(f"zero must be True / False or a ZeRO stage 0-3, got {zero!r}")
    return zero


def make_layer_strategy(layer, mesh: tuple, names: tuple, zero: bool | int = False,
                        micro_batches: int = 1):
    """The LayerStrategy of ``layer`` on ``mesh`` with 1-D signature ``names[d]`` on dim d, or
    None if it is not valid for the layer's shapes, or if it would split an attention
    layer's sequence at ``micro_batches`` micro-batches a step (a device then gets part of a
    sequence: the split must divide ``batch // micro_batches``). ``zero`` (`zero_stage`:
    True is 3): that ZeRO stage along the weight's ``B`` dims (None without a weight, a ``B``
    dim or a split that fits)."""
    stage = zero_stage(zero)
    if "pin" in names and not layer.accepts_partial:
        return None
    t = _template(layer.kind, len(layer.input_shape), len(layer.output_shape),
                  None if layer.weight_shape is None else len(layer.weight_shape),
                  tuple(mesh), tuple(names))
    if t is None:
        return None
    inp, w, out, splits = t
    for shape, f in zip((layer.input_shape, layer.output_shape, layer.weight_shape), splits):
        if f is not None and any(k > n for k, n in zip(f, shape)):
            return None     # a split finer than the axis
    if layer.kind == "attention":
        f = splits[0]
        n = _sequences(layer, micro_batches)
        if n == 0 or n % f[0] or layer.attrs.get("heads", 1) % f[1]:
            return None
    stored = _stored(layer, w, mesh) if stage else None
    if stage and stored is None:
        return None
    key = (tuple(mesh), inp, w, out, stored, tuple(names), stage)
    s = _STRATEGIES.get(key)
    if s is None:
        s = _STRATEGIES.put(key, LayerStrategy(*key[:6], zero=stage))
    return s


# one object per distinct strategy: layers of a kind share their spaces' strategies, so each
# is built and hashed once (a search hashes one for every node term it reads)
_STRATEGIES = BoundedDict("auto.layer_strategies", 1 << 16)


@memoize(1 << 14)
def _template(kind: str, in_ndim: int, out_ndim: int, w_ndim: int | None, mesh: tuple,
              names: tuple) -> tuple | None:
    """What `make_layer_strategy` reads of a layer's kind and ranks alone: ``(input, weight,
    output, splits)`` for the 1-D signatures ``names`` on ``mesh`` (the input clipped to its
    axes; weight None without one; ``splits``: each layout's split product per axis, for
    the shape checks), or None when a name is not the kind's or an embedding's ids would be
    split along an axis past the first."""
    sigs = SIGNATURES[kind]
    if any(n not in sigs for n in names):
        return None
    parts = [sigs[n] for n in names]
    inp = _clip_axis(tuple(p[0] for p in parts), in_ndim)
    out = tuple(p[2] for p in parts)
    w = tuple(p[1] for p in parts) if w_ndim is not None else None
    if kind == "embedding" and any(isinstance(x, Split) and x.axis > 0 for x in inp):
        return None
    splits = (tuple(_splits(inp, mesh, in_ndim)), tuple(_splits(out, mesh, out_ndim)),
              None if w is None else tuple(_splits(w, mesh, w_ndim)))
    return inp, w, out, splits


def _stored(layer, w: tuple | None, mesh: tuple) -> tuple | None:
    """ZeRO's split layout of weight layout ``w``: ``S(0)`` on each ``B`` dim (None without
    a weight, a ``B`` dim or a split that fits the weight)."""
    if w is None or not any(s == B for s in w):
        return None
    stored = tuple(S(0) if s == B else s for s in w)
    return stored if _fits(layer.weight_shape, stored, mesh) else None


def zero_twin(layer, s: LayerStrategy, zero: bool | int) -> LayerStrategy:
    """``s`` with ZeRO stage ``zero`` (`zero_stage`) along its weight's ``B`` dims (as
    `make_layer_strategy` builds it); without ZeRO when the stage is 0 or ``s`` has no
    weight or no ``B`` dim to split (a weightless or tensor-parallel-only layer)."""
    stage = zero_stage(zero)
    stored = _stored(layer, s.weight, s.mesh) if stage else None
    return replace(s, stored=stored, zero=stage if stored is not None else 0)


_SPACE_CACHE = BoundedDict("auto.layer_space", 1 << 12)


def _zero_stages(zero) -> tuple:
    """The ZeRO stages of a space: 0, and those ``zero`` asks (True: 3; a stage; stages)."""
    if isinstance(zero, (tuple, list, set, frozenset)):
        return (0,) + tuple(sorted({zero_stage(z) for z in zero} - {0}))
    z = zero_stage(zero)
    return (0, z) if z else (0,)


def layer_space(layer, p: int, max_dims: int = 3, zero: bool | int | tuple = False,
                recompute: bool = False, micro_batches: int = 1) -> list[LayerStrategy]:
    """Every valid strategy of ``layer`` on ``p`` devices (deduplicated, deterministic order).
    ``zero=True`` adds, for each strategy with a replicated weight, its ZeRO-sharded twin
    (stage 3); a stage or a tuple of stages adds those stages' twins instead;
    ``recompute=True`` then adds every strategy's twin that recomputes the layer's forward
    in backward (after all the others, so the plain space's indices are unchanged).
    ``micro_batches``: an attention layer's batch split keeps whole sequences of one
    micro-batch (empty when the count does not divide its batch)."""
    seqs = _sequences(layer, micro_batches) if layer.kind == "attention" else None
    stages = _zero_stages(zero)
    key = (layer.key, p, max_dims, stages, recompute, seqs)
    hit = _SPACE_CACHE.get(key)
    if hit is not None:
        return hit
    names = list(SIGNATURES[layer.kind])
    out, seen = [], set()
    for mesh in meshes(p, max_dims):
        for combo in _product(names, len(mesh)):
            if p > 1 and all(n == "rep" for n in combo) and len(mesh) > 1:
                continue  # the same as rep on a 1-D mesh
            for z in stages:
                s = make_layer_strategy(layer, mesh, combo, z, micro_batches)
                if s is None:
                    continue
                k = (s.mesh, s.input, s.weight, s.output, s.stored, s.zero)
                if k not in seen:
                    seen.add(k)
                    out.append(s)
    if recompute:
        out += [replace(s, recompute=True) for s in out]
    return _SPACE_CACHE.put(key, out)


def _product(names, k):
    if k == 0:
        yield ()
        return
    for rest in _product(names, k - 1):
        for n in names:
            yield rest + (n,)


def space(graph, p: int, max_dims: int = 3, zero: bool | int | tuple = False,
          recompute: bool = False, micro_batches: int = 1) -> dict:
    """Layer name -> list of LayerStrategy (`layer_space`)."""
    return {l.name: layer_space(l, p, max_dims, zero, recompute, micro_batches)
            for l in graph.layers}


def _tied_weight(layer, s: LayerStrategy) -> tuple | None:
    """The weight layout (the search's axes) the kernel of ``s`` uses: ``s.weight``, or for a
    tied layer (no weight of its own) the weight of the signature whose input and output
    per mesh dim are those of ``s`` (None if none, or not one)."""
    if s.weight is not None:
        return s.weight
    sigs = SIGNATURES[layer.kind].values()
    out = []
    for i, o in zip(s.input, s.output):
        ws = {sig[1] for sig in sigs if sig[1] is not None and sig[2] == o and
              _clip_axis((sig[0],), len(layer.input_shape))[0] == i}
        if len(ws) != 1:
            return None
        out.append(ws.pop())
    return tuple(out)


def weight_layout(layer, s: LayerStrategy) -> MeshLayout | None:
    """The `MeshLayout` of the weight of ``s`` in the module's axes (a linear's weight is
    ``(d_in, d_out)`` in the search and ``(out, in)`` in torch, so its axes swap); None
    without one."""
    w = _tied_weight(layer, s)
    if w is None:
        return None
    if layer.kind == "linear":
        w = tuple(S(1 - x.axis) if isinstance(x, Split) and x.axis < 2 else x for x in w)
    return MeshLayout(tuple(s.mesh), w)


def tie_agrees(holder, hs: LayerStrategy, tied, ts: LayerStrategy) -> bool:
    """Whether tied layer ``tied`` under ``ts`` runs with the weight of ``holder`` laid out as
    ``hs`` has it (same mesh, same layout in the module's axes; docs/auto.md, 'Tied
    weights and pipelined strategies'). The search keeps every tie agreeing."""
    a = weight_layout(holder, hs)
    return a is not None and a == weight_layout(tied, ts)


def tie_agreement(holder, holder_cands: list, tied, tied_cands: list) -> np.ndarray:
    """`tie_agrees` of every pair: ``[a, b]`` for the holder's candidate a and the tied
    layer's candidate b, each candidate's weight layout found once (not once a pair)."""
    ids: dict = {}
    hw = np.array([-1 if w is None else ids.setdefault(w, len(ids))
                   for w in (weight_layout(holder, s) for s in holder_cands)])
    tw = np.array([-2 if w is None else ids.get(w, -2)
                   for w in (weight_layout(tied, s) for s in tied_cands)])
    return hw[:, None] == tw[None, :]


__getattr__ = renamed(__name__, {"Pipeline": "PipelineShape"})  # the old name, for one release
