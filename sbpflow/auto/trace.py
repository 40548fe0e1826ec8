"""``sf.auto.trace``: the graph of layers of an ``sf.nn`` model, from one forward run on shapes.

Every `Linear`, `Embedding` and `Conv2d` module is recorded the first time it is called (a
module called again, e.g. a tied head, keeps its first entry), in call order; the layers form a
chain in that order. Shapes follow the axis conventions of `graph`: a linear's input is
``(tokens, in)`` with ``tokens`` the product of the leading axes, its weight ``(in, out)`` (the
transpose of the module's ``(out, in)``); an embedding's input is its ids, flattened; a conv's
input ``(N, Cin, H, W)`` (an unbatched ``(Cin, H, W)`` input counts as ``N = 1``), its weight
the module's ``(Cout, Cin / groups, kh, kw)``. Weightless ops between them (activations, norms,
pooling, attention, residual adds) are not layers: they follow the layouts around them.

Each layer's ``attrs["megatron"]`` is the Megatron role (linears alternate column / row in call
order, which is Megatron's pairing for the example GPT and MLP; embeddings split the vocabulary,
convs their output channels), so `baselines.megatron` gives the expert strategy of a traced
model.

By default (``meta=True``) the forward runs on *shapes only*: every parameter, buffer and input
is temporarily replaced by a tensor of its full logical shape and dtype whose shard is a
``meta`` tensor (no storage), on a one-rank placement of the calling rank (there every layout is
the same and no boxing or collective happens), and restored afterwards. So the trace allocates
no weights, computes nothing and never communicates; each rank may call it alone, and it works
on a model built under `sf.nn.init.meta_init` (too large to build for real). ``meta=False``
runs the real forward with the real weights instead (a collective: every rank calls it).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..errors import SbpError, TraceError
from ..sbp import B
from .graph import Graph, Layer

__all__ = ["trace", "TraceError"]


def _torch_itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def trace(model, example_inputs, name: str | None = None, *, meta: bool = True
          ) -> tuple[Graph, dict]:
    """``(graph, modules)``: the `Graph` of ``model``'s Linear / Embedding / Conv2d calls on
    ``example_inputs`` (a tuple of forward arguments: global tensors, torch tensors, or other
    values passed through) and ``{layer name: module}``.

    With ``meta=True`` (default) nothing is allocated, computed or communicated (see the
    module docstring) and the model is left exactly as it was; with ``meta=False`` the real
    forward runs under ``torch.no_grad`` (torch inputs replicated onto the placement of the
    model's parameters; a collective)."""
    from ..nn.modules import Conv2d, Embedding, Linear

    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    params = list(model.parameters())
    if not params:
        raise TraceError(f"sf.auto.trace: the model {type(model).__name__} has no parameters")
    records: list = []
    seen: set = set()
    wrapped = []
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

    for m in model.modules():
        kind = "linear" if isinstance(m, Linear) else "embedding" if isinstance(m, Embedding) \
            else "conv" if isinstance(m, Conv2d) else None
        if kind is None:
            continue
        wrapped.append((m, m.__dict__.get("forward")))   # an instance forward (parallelize)
        object.__setattr__(m, "forward", make(m, kind))
    try:
        if meta:
            _run_on_shapes(model, example_inputs, params[0].placement.device_type)
        else:
            pl = params[0].placement
            args = [_replicate(a, pl) if isinstance(a, torch.Tensor) else a
                    for a in example_inputs]
            with torch.no_grad():
                model(*args)
    finally:
        for m, prev in wrapped:
            if prev is None:
                m.__dict__.pop("forward", None)
            else:
                object.__setattr__(m, "forward", prev)
    layers = []
    linear_i = 0
    for lname, kind, xs, ys, m in records:
        if kind == "linear":
            tokens = math.prod(xs[:-1])
            attrs = {"megatron": "col" if linear_i % 2 == 0 else "row"}
            linear_i += 1
            layers.append(Layer(lname, "linear", (tokens, m.in_features),
                                (m.in_features, m.out_features), (tokens, m.out_features),
                                2.0 * tokens * m.in_features * m.out_features, False, attrs))
        elif kind == "embedding":
            tokens = math.prod(xs)
            layers.append(Layer(lname, "embedding", (tokens,),
                                (m.num_embeddings, m.embedding_dim), (tokens, m.embedding_dim),
                                2.0 * tokens * m.embedding_dim, False, {"megatron": "vocab"}))
        else:
            xs = xs if len(xs) == 4 else (1,) + xs
            ys = ys if len(ys) == 4 else (1,) + ys
            w = tuple(m.weight.shape)
            attrs = {"megatron": "outch"}
            if m.groups != 1:
                attrs["groups"] = m.groups
            flops = 2.0 * ys[0] * w[0] * w[1] * w[2] * w[3] * ys[2] * ys[3]
            layers.append(Layer(lname, "conv", xs, w, ys, flops, False, attrs))
    if not layers:
        raise TraceError(f"sf.auto.trace: the forward of {type(model).__name__} called no "
                         f"Linear, Embedding or Conv2d module")
    floats = [p.dtype for p in params if p.dtype.is_floating_point]
    graph = Graph(layers, name=name or type(model).__name__,
                  itemsize=_torch_itemsize(floats[0] if floats else params[0].dtype))
    return graph, {r[0]: r[4] for r in records}


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
