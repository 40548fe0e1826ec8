"""The model as the search sees it: a graph of layers with shapes, no weights.

Each `Layer` has a ``kind`` (linear, conv, embedding, attention, pool / act, interaction) that
selects its per-mesh-dim signatures (see `space`), the logical shapes of its input, weight and
output in fixed axis conventions, and its forward flops. ``edges`` are (producer, consumer)
names, a chain by default, an in-tree at most; ``accepts_partial`` lets a partial sum flow in
unreduced. See docs/auto.md, 'The layer graph' (the axis conventions table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Layer", "LayerGraph"]


@dataclass(eq=False)
class Layer:
    """One layer. ``tied`` names the layer whose weight this one uses (the first user of a
    shared parameter holds it); a tied layer's ``weight_shape`` is None, so its parameters,
    memory and gradient sync are the holder's alone (docs/auto.md, 'Tied weights')."""

    name: str
    kind: str
    input_shape: tuple
    weight_shape: tuple | None
    output_shape: tuple
    flops: float = 0.0
    accepts_partial: bool = False
    attrs: dict = field(default_factory=dict)
    tied: str | None = None

    @property
    def params(self) -> int:
        """Elements of the layer's weight (0 for a layer without one, or a tied one)."""
        return math.prod(self.weight_shape) if self.weight_shape else 0

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        self.__dict__.pop("_key", None)     # a field changed: `key` is found again

    @property
    def key(self) -> tuple:
        """Layers with equal keys have the same strategy space and per-layer costs (found
        once: a search reads it for every cached term; a layer's ``attrs`` are not changed
        in place)."""
        k = self.__dict__.get("_key")
        if k is None:
            k = self.__dict__["_key"] = self._find_key()
        return k

    def _find_key(self) -> tuple:
        return (self.kind, tuple(self.input_shape), self.weight_shape and tuple(self.weight_shape),
                tuple(self.output_shape), float(self.flops), self.accepts_partial,
                tuple(sorted(self.attrs.items()))) + (("tied",) if self.tied else ())

    def __repr__(self) -> str:
        w = f" w{tuple(self.weight_shape)}" if self.weight_shape else \
            f" w of {self.tied}" if self.tied else ""
        return f"Layer({self.name}: {self.kind} {tuple(self.input_shape)}{w} -> {tuple(self.output_shape)})"


class LayerGraph:
    """Layers in a topological order plus (producer, consumer) edges (default: a chain)."""

    def __init__(self, layers, edges=None, name: str = "model", itemsize: int = 2,
                 optimizer_states: int = 2, optimizer_itemsize: int = 4,
                 batch: int | None = None):
        self.name = name
        self.batch = batch    # samples a step (a traced model's input axis 0); None: unknown
        self.layers: list[Layer] = list(layers)
        self.itemsize = int(itemsize)          # bytes per element of activations and weights
        self.optimizer_states = optimizer_states  # states per parameter element (Adam: 2)
        # bytes of a state element: fp32 beside 16-bit weights (mixed precision); a traced
        # sbpflow model's own dtype (its AdamW keeps the states in the parameter's dtype)
        self.optimizer_itemsize = int(optimizer_itemsize)
        self.index = {l.name: i for i, l in enumerate(self.layers)}
        if len(self.index) != len(self.layers):
            raise ValueError("layer names must be unique")
        if edges is None:
            edges = [(a.name, b.name) for a, b in zip(self.layers, self.layers[1:])]
        self.edges = [(self.index[a] if isinstance(a, str) else a,
                       self.index[b] if isinstance(b, str) else b) for a, b in edges]
        self.preds: list[list[int]] = [[] for _ in self.layers]
        self.succs: list[list[int]] = [[] for _ in self.layers]
        for a, b in self.edges:
            if a >= b:
                raise ValueError(f"edge {self.layers[a].name} -> {self.layers[b].name} goes "
                                 "against the layer order")
            self.preds[b].append(a)
            self.succs[a].append(b)
        for l in self.layers:
            self._check_tie(l)

    def _check_tie(self, layer: Layer) -> None:
        """A tied layer has no weight itself; its holder, when in the graph (a stage's part of
        a chain may leave it out), is an earlier layer with a weight."""
        if layer.tied is None:
            return
        holder = self.index.get(layer.tied)
        if holder is not None and (holder >= self.index[layer.name] or
                                   self.layers[holder].weight_shape is None):
            raise ValueError(f"layer {layer.name} is tied to {layer.tied!r}, which is not an "
                             f"earlier layer with a weight in {self.name}")
        if layer.weight_shape is not None:
            raise ValueError(f"layer {layer.name} is tied to {layer.tied}: its weight_shape "
                             f"must be None (the weight is counted at {layer.tied})")

    @property
    def ties(self) -> dict:
        """``{tied layer: the layer holding its weight}``."""
        return {l.name: l.tied for l in self.layers if l.tied is not None}

    @property
    def is_chain(self) -> bool:
        """Whether the layers form one chain (each feeds the next only), which the exact search
        needs."""
        return self.edges == [(i, i + 1) for i in range(len(self.layers) - 1)]

    @property
    def is_in_tree(self) -> bool:
        """Every layer feeds at most one consumer (what the dynamic programme needs)."""
        return all(len(s) <= 1 for s in self.succs)

    def __getitem__(self, name: str) -> Layer:
        return self.layers[self.index[name]]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self):
        return iter(self.layers)

    @property
    def params(self) -> int:
        """Weight elements, a tied weight once."""
        return sum(l.params for l in self.layers)

    def __repr__(self) -> str:
        return (f"LayerGraph({self.name}: {len(self.layers)} layers, "
                f"{self.params / 1e6:.1f} M params, {len(self.edges)} edges)")

    def summary(self) -> str:
        """A table of the layers: kind, input, weight and output shapes, GFLOP."""
        rows = [f"{'layer':<14}{'kind':<12}{'input':<22}{'weight':<20}{'output':<22}{'GFLOP':>10}"]
        for l in self.layers:
            w = str(tuple(l.weight_shape)) if l.weight_shape else f"={l.tied}" if l.tied else "-"
            rows.append(f"{l.name:<14}{l.kind:<12}{str(tuple(l.input_shape)):<22}{w:<20}"
                        f"{str(tuple(l.output_shape)):<22}{l.flops / 1e9:>10.2f}")
        return "\n".join(rows)
