"""``sf.auto.trace``: the graph of layers of an ``sf.nn`` model, from one forward run on shapes.

Every `Linear`, `Embedding` and `Conv2d` module is recorded the first time it is called, in call
order, as a chain of layers with the axis conventions of `graph` and a Megatron role
(``attrs["megatron"]``); weightless ops between them are not layers. A layer whose weight is an
earlier layer's (tied) is marked ``tied`` and has no weight of its own. By default (``meta=True``)
the forward runs on storage-less stand-ins on a one-rank placement: no weights allocated,
nothing computed or communicated. See docs/auto.md, 'Tracing a model'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from ..errors import SbpError, TraceError
from ..sbp import B
from .graph import Graph, Layer
from .model_graphs import linear_layer

__all__ = ["trace", "TraceError", "graph_weight_shape"]


def _torch_itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def trace(model, example_inputs, name: str | None = None, *, meta: bool = True
          ) -> tuple[Graph, dict]:
    """``(graph, modules)``: the `Graph` of ``model``'s Linear / Embedding / Conv2d calls on
    ``example_inputs`` (a tuple of forward arguments: global tensors, torch tensors, or other
    values passed through) and ``{layer name: module}``.

    With ``meta=True`` (default) nothing is allocated, computed or communicated (docs/auto.md,
    'Tracing a model') and the model is left exactly as it was; with ``meta=False`` the real
    forward runs under ``torch.no_grad`` (torch inputs replicated onto the placement of the
    model's parameters; a collective)."""
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    params = list(model.parameters())
    if not params:
        raise TraceError(f"sf.auto.trace: the model {type(model).__name__} has no parameters")
    records: list = []
    wrapped = _wrap_layers(model, records)
    try:
        _run_forward(model, example_inputs, params[0].placement, meta)
    finally:
        _unwrap(wrapped)
    layers = _layers(records)
    if not layers:
        raise TraceError(f"sf.auto.trace: the forward of {type(model).__name__} called no "
                         f"Linear, Embedding or Conv2d module")
    floats = [p.dtype for p in params if p.dtype.is_floating_point]
    itemsize = _torch_itemsize(floats[0] if floats else params[0].dtype)
    graph = Graph(layers, name=name or type(model).__name__, itemsize=itemsize,
                  optimizer_itemsize=itemsize, batch=_batch(example_inputs))
    return graph, {r[0]: r[4] for r in records}


def _batch(example_inputs) -> int | None:
    """Samples a step: axis 0 of the first tensor input (None without one)."""
    for a in example_inputs:
        if hasattr(a, "shape") and len(a.shape) > 0:
            return int(a.shape[0])
    return None


# -- recording the layer calls -------------------------------------------------------------------
def _wrap_layers(model, records: list) -> list:
    """Give every Linear / Embedding / Conv2d of ``model`` an instance forward that appends
    ``(name, kind, input shape, output shape, module)`` to ``records`` on its first call.
    Returns ``[(module, previous instance forward or None)]`` for `_unwrap`."""
    from ..nn.modules import Conv2d, Embedding, Linear

    seen: set = set()
    names = {id(m): n for n, m in model.named_modules()}

    def make(m, kind):
        # the class's forward: a forward wrapped by `parallelize` would box onto real placements
        orig = type(m).forward.__get__(m)

        def fwd(x, *rest, **kw):
            y = orig(x, *rest, **kw)
            if id(m) not in seen:
                seen.add(id(m))
                records.append((names[id(m)], kind, tuple(x.shape), tuple(y.shape), m))
            return y
        return fwd

    wrapped = []
    for m in model.modules():
        kind = "linear" if isinstance(m, Linear) else "embedding" if isinstance(m, Embedding) \
            else "conv" if isinstance(m, Conv2d) else None
        if kind is None:
            continue
        wrapped.append((m, m.__dict__.get("forward")))   # an instance forward (parallelize)
        object.__setattr__(m, "forward", make(m, kind))
    return wrapped


def _unwrap(wrapped: list) -> None:
    """Put back the instance forwards `_wrap_layers` replaced (or remove the ones it added)."""
    for m, prev in wrapped:
        if prev is None:
            m.__dict__.pop("forward", None)
        else:
            object.__setattr__(m, "forward", prev)


def _run_forward(model, example_inputs: Sequence[Any], pl, meta: bool) -> None:
    """One forward of ``model``: on shapes only (``meta``), else the real one under
    ``torch.no_grad`` with torch inputs replicated onto ``pl`` (a collective)."""
    if meta:
        _run_on_shapes(model, example_inputs, pl.device_type)
        return
    args = [_replicate(a, pl) if isinstance(a, torch.Tensor) else a for a in example_inputs]
    with torch.no_grad():
        model(*args)


def graph_weight_shape(kind: str, module) -> tuple:
    """The weight of a traced ``module`` in the graph's axis conventions: a linear's
    ``(in, out)`` (the transpose of the module's), an embedding's or conv's as the module's."""
    if kind == "linear":
        return (module.in_features, module.out_features)
    return tuple(module.weight.shape)


def _layers(records: list) -> list:
    """The `Layer` of each record, in call order (linears alternate Megatron col / row). A
    module whose weight an earlier layer holds (a tied LM head) becomes a layer ``tied`` to it,
    without a weight of its own; tied to an embedding, its Megatron role is the vocabulary
    split (``col``: the module's weight split on its rows, as the embedding's)."""
    layers: list = []
    holders: dict = {}      # id(weight parameter) -> the layer holding it
    linear_i = 0
    for lname, kind, xs, ys, m in records:
        if kind == "linear":
            layer = linear_layer(lname, math.prod(xs[:-1]), m.in_features, m.out_features,
                                 megatron="col" if linear_i % 2 == 0 else "row")
            linear_i += 1
        elif kind == "embedding":
            tokens = math.prod(xs)
            layer = Layer(lname, "embedding", (tokens,), (m.num_embeddings, m.embedding_dim),
                          (tokens, m.embedding_dim), 2.0 * tokens * m.embedding_dim, False,
                          {"megatron": "vocab"})
        else:
            layer = _conv_layer(lname, xs, ys, m)
        w = getattr(m, "weight", None)
        holder = holders.get(id(w)) if w is not None else None
        if holder is None:
            if w is not None:
                holders[id(w)] = layer
        else:
            attrs = dict(layer.attrs)
            if kind == "linear" and holder.kind == "embedding":
                attrs["megatron"] = "col"
            layer = dataclasses.replace(layer, weight_shape=None, attrs=attrs, tied=holder.name)
        layers.append(layer)
    return layers


def _conv_layer(lname: str, xs: tuple, ys: tuple, m) -> Layer:
    """A conv: ``(N, Cin, H, W)`` (an unbatched input counts as ``N = 1``), the module's
    weight; split on output channels for Megatron."""
    xs = xs if len(xs) == 4 else (1,) + xs
    ys = ys if len(ys) == 4 else (1,) + ys
    w = tuple(m.weight.shape)
    attrs = {"megatron": "outch"}
    if m.groups != 1:
        attrs["groups"] = m.groups
    flops = 2.0 * ys[0] * w[0] * w[1] * w[2] * w[3] * ys[2] * ys[3]
    return Layer(lname, "conv", xs, w, ys, flops, False, attrs)


# -- the forward on shapes only ----------------------------------------------------------------
def _run_on_shapes(model, example_inputs: Sequence[Any], device_type: str) -> None:
    """Run ``model(*example_inputs)`` with every parameter, buffer and tensor input replaced by
    a storage-less stand-in of its logical shape on a one-rank placement of this rank; the
    module's parameters and buffers are put back afterwards (also on error)."""
    from .. import comm as _comm
    from ..nn.modules import Parameter
    from ..placement import Placement
    from ..tensor import GlobalTensor

    one = Placement(device_type, [_comm.rank()])

    def shadow(t):
        shape = tuple(t.shape)
        local = torch.empty(shape, dtype=t.dtype, device="meta")
        return GlobalTensor(local, shape, one, (B,))

    saved = []      # (module, dict name, key, original)
    stand_in: dict = {}    # id(original) -> shadow: tied tensors stay tied
    for m in model.modules():
        for dict_name in ("_parameters", "_buffers"):
            d = m.__dict__[dict_name]
            for key, t in list(d.items()):
                if t is None:
                    continue
                if id(t) not in stand_in:
                    s = shadow(t)
                    stand_in[id(t)] = (Parameter(s, requires_grad=False)
                                       if isinstance(t, Parameter) else s)
                saved.append((d, key, t))
                d[key] = stand_in[id(t)]
    args = [shadow(a) if isinstance(a, (torch.Tensor, GlobalTensor)) else a
            for a in example_inputs]
    try:
        with torch.no_grad():
            model(*args)
    except SbpError:
        raise
    except Exception as exc:   # a data-dependent op (e.g. .item()) cannot run on shapes
        raise TraceError(
            f"sf.auto.trace: the forward of {type(model).__name__} failed on meta tensors "
            f"(shapes only) with {type(exc).__name__}: {exc}; if it needs values, trace with "
            f"meta=False (the real forward, a collective)") from exc
    finally:
        for d, key, t in saved:
            d[key] = t


def _replicate(t, pl):
    from ..tensor import tensor as _sf_tensor
    return _sf_tensor(t, pl, (B,) * pl.ndim)
