"""``sf.auto.trace``: the graph of layers of an ``sf.nn`` model, from one forward run.

Every `Linear` and `Embedding` module is recorded the first time it is called (a module called
again, e.g. a tied head, keeps its first entry), in call order; the layers form a chain in that
order. Shapes follow the axis conventions of `graph` (a linear's input is ``(tokens, in)`` with
``tokens`` the product of the leading axes; its weight ``(in, out)``, the transpose of the
module's ``(out, in)``). Weightless ops between them (activations, norms, attention, residual
adds) are not layers: they follow the layouts around them.

Each layer's ``attrs["megatron"]`` is the Megatron role (linears alternate column / row in call
order, which is Megatron's pairing for the example GPT and MLP; embeddings split the vocabulary),
so `baselines.megatron` gives the expert strategy of a traced model.

The forward run uses the model's real weights (no meta tensors): it is a collective, so every
rank calls it, under ``torch.no_grad``.
"""

from __future__ import annotations

import math

import torch

from .graph import Graph, Layer

__all__ = ["trace"]


def _torch_itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def trace(model, example_inputs, name: str | None = None):
    """``(graph, modules)``: the `Graph` of ``model``'s Linear / Embedding calls on
    ``example_inputs`` (a tuple of forward arguments: global tensors, or torch tensors that are
    replicated onto the placement of the model's parameters) and ``{layer name: module}``."""
    from ..nn.modules import Embedding, Linear

    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    params = list(model.parameters())
    if not params:
        raise ValueError("sf.auto.trace: the model has no parameters")
    pl = params[0].placement
    args = [_replicate(a, pl) if isinstance(a, torch.Tensor) else a for a in example_inputs]
    records: list = []
    seen: set = set()
    wrapped = []
    names = {id(m): n for n, m in model.named_modules()}
    linear_i = [0]

    def make(m, kind):
        orig = m.forward

        def fwd(x, *rest, **kw):
            y = orig(x, *rest, **kw)
            if id(m) not in seen:
                seen.add(id(m))
                records.append((names[id(m)], kind, tuple(x.shape), tuple(y.shape), m))
            return y
        return fwd

    for m in model.modules():
        kind = "linear" if isinstance(m, Linear) else "embedding" if isinstance(m, Embedding) \
            else None
        if kind is None:
            continue
        wrapped.append((m, m.__dict__.get("forward")))   # an instance forward (parallelize)
        object.__setattr__(m, "forward", make(m, kind))
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for m, prev in wrapped:
            if prev is None:
                m.__dict__.pop("forward", None)
            else:
                object.__setattr__(m, "forward", prev)
    layers = []
    for lname, kind, xs, ys, m in records:
        if kind == "linear":
            tokens = math.prod(xs[:-1])
            attrs = {"megatron": "col" if linear_i[0] % 2 == 0 else "row"}
            linear_i[0] += 1
            layers.append(Layer(lname, "linear", (tokens, m.in_features),
                                (m.in_features, m.out_features), (tokens, m.out_features),
                                2.0 * tokens * m.in_features * m.out_features, False, attrs))
        else:
            tokens = math.prod(xs)
            layers.append(Layer(lname, "embedding", (tokens,),
                                (m.num_embeddings, m.embedding_dim), (tokens, m.embedding_dim),
                                2.0 * tokens * m.embedding_dim, False, {"megatron": "vocab"}))
    if not layers:
        raise ValueError("sf.auto.trace: the forward run called no Linear or Embedding module")
    graph = Graph(layers, name=name or type(model).__name__,
                  itemsize=_torch_itemsize(params[0].dtype))
    return graph, {r[0]: r[4] for r in records}


def _replicate(t, pl):
    from ..tensor import tensor as _sf_tensor
    from ..sbp import B
    return _sf_tensor(t, pl, (B,) * pl.ndim)
