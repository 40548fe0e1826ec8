"""``sf.auto.trace``: the graph of layers of an ``sf.nn`` model, from one forward run on shapes.

Every `Linear`, `Embedding` and `Conv2d` module (and Hugging Face's ``Conv1D``, a linear stored
``(in, out)``) is recorded the first time it is called, in call order, as a chain of layers with
the axis conventions of `graph` and a Megatron role (``attrs["megatron"]``); weightless ops
between them are not layers. A layer whose weight is an earlier layer's (tied) is marked
``tied`` and has no weight of its own. By default (``meta=True``) the forward runs in a world of
one rank on storage-less (fake) stand-ins of the weights and with the inputs' values: no weight
allocated, nothing communicated, only what the inputs alone determine computed (masks,
positions, sizes). See docs/auto.md, 'Tracing a model'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
from typing import Any, Sequence

import torch

from ..errors import (CommError, PlacementError, PlacementMismatchError, SbpError,
                      TraceError)
from ..sbp import B, Broadcast
from .layer_graph import LayerGraph, Layer
from .model_graphs import linear_layer

__all__ = ["trace", "TraceError", "graph_weight_shape", "stores_in_out"]


def _torch_itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def trace(model, example_inputs, name: str | None = None, *, meta: bool = True
          ) -> tuple[LayerGraph, dict]:
    """``(graph, modules)``: the `LayerGraph` of ``model``'s Linear / Embedding / Conv2d (and
    Hugging Face ``Conv1D``) calls on ``example_inputs`` (a tuple of positional forward
    arguments, a dict of keyword ones, or one tensor: global tensors, torch tensors, or other
    values passed through) and ``{layer name: module}``.

    With ``meta=True`` (default) no weight is allocated, nothing the weights compute is
    computed and nothing is communicated (docs/auto.md, 'Tracing a model'); the model is left
    exactly as it was. With ``meta=False`` the real forward runs under ``torch.no_grad``
    (torch inputs replicated onto the placement of the model's parameters; a collective)."""
    args, kwargs = _arguments(example_inputs)
    params = list(model.parameters())
    if not params:
        raise TraceError(f"sf.auto.trace: the model {type(model).__name__} has no parameters")
    records: list = []
    wrapped = _wrap_layers(model, records)
    try:
        _run_forward(model, args, kwargs, params[0].placement, meta)
    finally:
        _unwrap(wrapped)
    layers = _layers(records, _declared_roles(model))
    if not layers:
        raise TraceError(f"sf.auto.trace: the forward of {type(model).__name__} called no "
                         f"Linear, Embedding, Conv2d or Conv1D module")
    floats = [p.dtype for p in params if p.dtype.is_floating_point]
    itemsize = _torch_itemsize(floats[0] if floats else params[0].dtype)
    graph = LayerGraph(layers, name=name or type(model).__name__, itemsize=itemsize,
                  optimizer_itemsize=itemsize, batch=_batch(list(args) + list(kwargs.values())))
    return graph, {r[0]: r[4] for r in records}


def _arguments(example_inputs) -> tuple:
    """``(positional arguments, keyword arguments)`` of the forward: a dict is keywords, a
    tuple or list positional, anything else the one positional argument."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


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
    from ..nn.layers import Conv2d, Embedding, Linear

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
            else "conv" if isinstance(m, Conv2d) else "linear" if stores_in_out(m) else None
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


def _run_forward(model, args: tuple, kwargs: dict, pl, meta: bool) -> None:
    """One forward of ``model``: on shapes only (``meta``), else the real one under
    ``torch.no_grad`` with torch inputs replicated onto ``pl`` (a collective)."""
    if meta:
        _run_on_shapes(model, args, kwargs, pl.device_type)
        return

    def placed(a):
        return _replicate(a, pl) if isinstance(a, torch.Tensor) else a
    with torch.no_grad():
        model(*[placed(a) for a in args], **{k: placed(v) for k, v in kwargs.items()})


def stores_in_out(module) -> bool:
    """Whether ``module`` is a linear layer that stores its weight ``(in, out)``, the transpose
    of ``nn.Linear``'s: Hugging Face's ``Conv1D`` (GPT-2's attention and MLP; ``x @ W + b``),
    converted or not (its class, or one it derives from, is transformers' ``Conv1D``)."""
    w = getattr(module, "weight", None)
    return w is not None and len(w.shape) == 2 and any(
        c.__name__ == "Conv1D" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__)


def graph_weight_shape(kind: str, module) -> tuple:
    """The weight of a traced ``module`` in the graph's axis conventions: a linear's
    ``(in, out)`` (the transpose of an ``nn.Linear``'s; a `stores_in_out` module's own), an
    embedding's or conv's as the module's."""
    if kind == "linear" and stores_in_out(module):
        return tuple(module.weight.shape)
    if kind == "linear":
        return (module.in_features, module.out_features)
    return tuple(module.weight.shape)


def _declared_roles(model) -> dict:
    """``{parameter pattern: "col" | "row"}`` from the tensor-parallel plan a Hugging Face
    model declares (`sf.parallel.hf_tp_plan`: colwise / rowwise, in the plan's order), or
    ``{}`` for a model without one."""
    from ..parallel.hf_plan import hf_tp_plan
    if getattr(model, "config", None) is None:
        return {}
    try:
        rules = hf_tp_plan(model)
    except SbpError:
        return {}
    kinds = {"colwise": "col", "rowwise": "row"}
    return {k: kinds[v.kind] for k, v in rules.items() if getattr(v, "kind", None) in kinds}


def _role(lname: str, roles: dict, linear_i: int) -> str:
    """A linear's Megatron role: the declared plan's for its weight (the first pattern that
    matches), else column / row alternating in call order."""
    for pattern, role in roles.items():
        if fnmatch.fnmatchcase(f"{lname}.weight", pattern):
            return role
    return "col" if linear_i % 2 == 0 else "row"


def _layers(records: list, roles: dict | None = None) -> list:
    """The `Layer` of each record, in call order (linears alternate Megatron col / row). A
    module whose weight an earlier layer holds (a tied LM head) becomes a layer ``tied`` to it,
    without a weight of its own; tied to an embedding, its Megatron role is the vocabulary
    split (``col``: the module's weight split on its rows, as the embedding's)."""
    layers: list = []
    holders: dict = {}      # id(weight parameter) -> the layer holding it
    linear_i = 0
    for lname, kind, xs, ys, m in records:
        if kind == "linear":
            d_in, d_out = graph_weight_shape(kind, m)
            extra = {"weight_in_out": True} if stores_in_out(m) else {}
            layer = linear_layer(lname, math.prod(xs[:-1]), d_in, d_out,
                                 megatron=_role(lname, roles or {}, linear_i), **extra)
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
# raised on shapes by a tensor of the model's placement (not swapped): the world is of one
_OUTSIDE = (PlacementError, PlacementMismatchError, CommError)
SUGGESTION = ("trace with meta=False (the real forward on the example inputs, a collective: "
              "sf.auto.trace(..., meta=False), sf.auto.parallelize(..., meta=False))")


def _one_rank_world():
    """A communicator of a world of one rank (rank 0) whose devices are the calling rank's
    (a rank of a cuda placement keeps its own GPU for what the forward creates)."""
    from .. import comm as _comm
    from ..comm.threads import ThreadCommunicator, ThreadWorld

    outer = _comm.current()

    class OneRank(ThreadCommunicator):
        def device(self, device_type: str) -> torch.device:
            return outer.device(device_type)
    return OneRank(ThreadWorld(1), 0)


@contextlib.contextmanager
def _world_of_one():
    """The calling thread in a world of one rank (`_one_rank_world`) meanwhile: every
    placement of the trace is that rank's own, so reading a value (``.item()``, ``bool``) and
    boxing stay local and nothing reaches the other ranks. Its communicator is put back
    afterwards."""
    from ..comm import rank_local
    local = rank_local()
    previous = local.comm
    local.comm = _one_rank_world()
    try:
        yield
    finally:
        local.comm = previous


def _stand_ins(device_type: str):
    """``(shadow, known)``: ``shadow(t)`` a global tensor of ``t``'s logical shape and dtype
    on the one-rank placement whose shard is a fake tensor (torch's ``FakeTensorMode``: a
    tensor on this rank's device without storage, so ``x.device`` and ``.to(x.device)`` read
    as on the real model); ``known(a)`` an input with its values where this rank holds them
    all (a torch tensor, moved to this rank's device; a global tensor replicated on every
    mesh dim), else its shadow; other values as they are."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from .. import comm as _comm
    from ..placement import Placement
    from ..tensor import GlobalTensor

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    one = Placement(device_type, [0])
    device = _comm.current().device(device_type)

    def shadow(t):
        shape = tuple(t.shape)
        with fake_mode:
            local = torch.empty(shape, dtype=t.dtype, device=device)
        return GlobalTensor(local, shape, one, (B,))

    def known(a):
        if isinstance(a, torch.Tensor) and not isinstance(a, GlobalTensor):
            return GlobalTensor(a.detach().to(device), tuple(a.shape), one, (B,))
        if not isinstance(a, GlobalTensor):
            return a
        if all(isinstance(s, Broadcast) for s in a.sbp) and not a.local.is_meta and \
                _comm.rank() in a.placement.flat_ranks:
            return GlobalTensor(a.local.detach(), tuple(a.shape), one, (B,))
        return shadow(a)
    return shadow, known


def _swap_state(model, shadow) -> list:
    """Replace every parameter and buffer of ``model`` by its shadow (tied tensors by one
    shadow); returns ``[(dict, key, original)]`` for putting them back."""
    from ..nn.modules import Parameter
    saved = []
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
    return saved


def _run_on_shapes(model, args: tuple, kwargs: dict, device_type: str) -> None:
    """Run ``model(*args, **kwargs)`` in a world of one rank (`_world_of_one`) with every
    parameter and buffer replaced by a storage-less stand-in of its logical shape, inputs
    with their values where this rank holds them (`_stand_ins`); the module's parameters
    and buffers are put back afterwards (also on error). What only the inputs determine
    (positions, masks, sizes read with ``.item()``) is computed; what the weights do is
    shapes only, and reading such a value raises `TraceError`."""
    shadow, known = _stand_ins(device_type)
    given = list(enumerate(args)) + list(kwargs.items())
    args = [known(a) for a in args]                  # (this rank's view of the inputs)
    kwargs = {k: known(v) for k, v in kwargs.items()}
    unknown = [k for (k, a), b in zip(given, args + list(kwargs.values()))
               if b is not a and _is_fake(b)]
    with _world_of_one():
        saved = _swap_state(model, shadow)
        try:
            with torch.no_grad():
                model(*args, **kwargs)
        except SbpError as exc:
            if not isinstance(exc, _OUTSIDE):
                raise
            raise TraceError(
                f"sf.auto.trace: the forward of {type(model).__name__} reached a tensor that "
                f"is neither a parameter, a buffer nor an input (a placement of other ranks) "
                f"with {type(exc).__name__}: {exc}; {SUGGESTION}") from exc
        except Exception as exc:   # a value of the weights (e.g. .item()) is not known
            raise TraceError(
                f"sf.auto.trace: the forward of {type(model).__name__} failed on shapes "
                f"(weights without values) with {type(exc).__name__}: {exc}; "
                f"{_unknown_inputs(unknown)}if it reads a value the weights compute, "
                f"{SUGGESTION}") from exc
        finally:
            for d, key, t in saved:
                d[key] = t


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(getattr(t, "local", None), FakeTensor)


def _unknown_inputs(unknown: list) -> str:
    """The advice for inputs traced without their values (split or partial global tensors:
    this rank holds part of them), or ''."""
    if not unknown:
        return ""
    return (f"the inputs {unknown} are split or partial, so the trace has no values of them "
            f"(give them replicated, x.to_global(sbp=sf.B): sf.auto.parallelize does); ")


def _replicate(t, pl):
    from ..tensor import tensor as _sf_tensor
    return _sf_tensor(t, pl, (B,) * pl.ndim)
