"""``sf.nn.from_torch``: a ``torch.nn.Module`` in, an sbpflow model out.

The converted model is a new object with the torch model's structure, attribute values,
parameter names and tied parameters; the torch model is left as it was. Each module becomes an
instance of a class derived from its own torch class and from `TorchConverted` (an `sf.nn.Module`),
so ``isinstance`` against both holds and the module's own ``forward`` runs unmodified: its torch
calls reach `GlobalTensor.__torch_function__` (`torch_functions`). A torch layer with an
``sf.nn`` twin (``Linear``, ``Embedding``, ``LayerNorm``, ``Conv2d``, activations, pooling,
containers) takes the twin's ``forward`` instead (one dispatch less, and `sf.auto.trace` sees its
layers). Parameters become `Parameter` s and buffers global tensors, replicated on the placement,
with the values of the placement's first rank (`_synced_values`: DDP's module-state sync); lay
them out afterwards with `sf.parallel.apply`. See docs/torch_models.md.
"""

from __future__ import annotations

import torch

from .. import comm as _comm
from ..errors import ShapeError
from ..placement import Placement
from ..sbp import B
from ..tensor import GlobalTensor, UnsupportedTorchFunction, _to_dtype, lift
from ..tensor import tensor as _sf_tensor
from ..utils import text_digest
from . import modules as M
from .init import meta_tensor
from .torch_generation import expanding, generating
from .modules import Module
from .parameter import Parameter

__all__ = ["from_torch", "TorchConverted", "is_torch_module"]


class TorchConverted(Module):
    """What every converted module adds to `sf.nn.Module`: torch's device and dtype moves,
    which a model of global tensors does differently (placements name the devices)."""

    def to(self, *args, **kwargs) -> "TorchConverted":
        """``to(dtype)`` casts the parameters and buffers (`sf.nn.Module.to`); a device of the
        parameters' device type is where they are; another device is refused."""
        probe = next(iter(self.parameters()), None)
        if probe is None:
            probe = next(iter(self.buffers()), None)
        if probe is None:
            return self
        dtype = _to_dtype(probe, args, kwargs)
        return self if dtype is None else super().to(dtype)

    def _placed(self, value: torch.Tensor) -> GlobalTensor:
        """A torch value replicated on the placement the model was converted for."""
        pl = self.__dict__.get("_sf_placement") or \
            Placement("cpu", list(range(_comm.world_size())))
        if isinstance(value, torch.nn.Parameter):
            return Parameter(value.detach(), requires_grad=value.requires_grad, placement=pl,
                             sbp=(B,) * pl.ndim)
        return _sf_tensor(value.detach(), pl, (B,) * pl.ndim)

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        """As `sf.nn.Module`'s; a plain torch tensor (a cache a ``forward`` builds) is laid out
        replicated on the placement the model was converted for."""
        if isinstance(tensor, torch.Tensor):
            tensor = self._placed(tensor)
        super().register_buffer(name, tensor, persistent)

    def __setattr__(self, name: str, value) -> None:
        """As `sf.nn.Module`'s; a torch parameter, or a torch tensor given to a buffer's name,
        is laid out replicated first (`_placed`)."""
        if isinstance(value, torch.Tensor) and (isinstance(value, torch.nn.Parameter) or
                                                name in self.__dict__.get("_buffers", ())):
            value = self._placed(value)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse: bool = True):
        raise UnsupportedTorchFunction(
            f"{type(self).__name__}: torch's Module._apply (cuda(), cpu(), half(), type(), "
            f"to(device)) cannot move a converted model's global tensors; lay them out with "
            f"sf.parallel.apply(model, sf.placement(...), rules) and cast with .to(dtype)")

    def cpu(self) -> "TorchConverted":
        return self.to("cpu")

    def cuda(self, device=None) -> "TorchConverted":
        return self.to("cuda")

    def half(self) -> "TorchConverted":
        return self.to(torch.float16)

    def type(self, dst_type) -> "TorchConverted":
        return self.to(dst_type)


def is_torch_module(model) -> bool:
    """Whether ``model`` is a ``torch.nn.Module`` not converted yet (`from_torch` takes it)."""
    return isinstance(model, torch.nn.Module) and not isinstance(model, Module)


# -- which sf.nn class a torch layer becomes ---------------------------------------------------------
def _twins() -> dict:
    nn = torch.nn
    twins = {nn.Linear: M.Linear, nn.LayerNorm: M.LayerNorm, nn.Embedding: M.Embedding,
             nn.Conv2d: M.Conv2d, nn.Dropout: M.Dropout, nn.GELU: M.GELU, nn.ReLU: M.ReLU,
             nn.Tanh: M.Tanh, nn.Sigmoid: M.Sigmoid, nn.SiLU: M.SiLU, nn.Identity: M.Identity,
             nn.Softmax: M.Softmax, nn.Flatten: M.Flatten, nn.MaxPool2d: M.MaxPool2d,
             nn.AvgPool2d: M.AvgPool2d, nn.AdaptiveAvgPool2d: M.AdaptiveAvgPool2d,
             nn.Sequential: M.Sequential, nn.ModuleList: M.ModuleList,
             nn.ModuleDict: M.ModuleDict}
    try:  # sf.nn's normalisation layers, when present
        from . import norm
    except ImportError:
        return twins
    for name in ("BatchNorm1d", "BatchNorm2d", "GroupNorm", "RMSNorm"):
        if hasattr(norm, name) and hasattr(nn, name):
            twins[getattr(nn, name)] = getattr(norm, name)
    return twins


def _twin_fits(m: torch.nn.Module) -> bool:
    """Whether the sf.nn twin's forward means what this instance's torch forward does (the
    arguments the twin ignores are at torch's defaults)."""
    nn = torch.nn
    if isinstance(m, nn.Embedding):
        return m.max_norm is None and not m.scale_grad_by_freq and not m.sparse
    if isinstance(m, nn.Conv2d):
        return m.padding_mode == "zeros"
    return True


_CLASSES: dict = {}
# class attributes a converted class does not take from the user's classes
_SKIP = frozenset({"__init__", "__dict__", "__weakref__", "__module__", "__doc__", "__qualname__",
                   "__slots__", "__annotations__", "__init_subclass__", "__orig_bases__",
                   "__parameters__", "__firstlineno__", "__static_attributes__",
                   "__abstractmethods__", "_abc_impl", "__new__", "__class_getitem__"})


def _user_namespace(cls: type) -> dict:
    """The attributes ``cls`` and its bases below ``torch.nn.Module`` define (``forward``,
    helpers, ``extra_repr``), nearest first: they must win over `sf.nn.Module`'s."""
    ns: dict = {}
    for c in cls.__mro__:
        if c is torch.nn.Module:
            break
        for k, v in vars(c).items():
            if k not in _SKIP and k not in ns:
                ns[k] = v
    return ns


def _converted_class(cls: type, twin: type | None) -> type:
    """``cls`` with `TorchConverted` (and ``twin``'s forward) in front, made once per pair.

    Not a subclass of the user class's methods alone: the MRO is (TorchConverted, [twin,]
    sf.nn.Module, cls, ..., torch.nn.Module), so `sf.nn.Module` answers the module protocol
    (parameters, state dicts, calls) while ``super()`` in the user's methods still works."""
    key = (cls, twin)
    hit = _CLASSES.get(key)
    if hit is None:
        bases = (TorchConverted, twin, cls) if twin is not None else (TorchConverted, cls)
        ns = {"__call__": _twin_call(cls)} if twin is not None else _user_namespace(cls)
        ns["__doc__"] = cls.__doc__
        if callable(getattr(cls, "_expand_inputs_for_generation", None)):
            _generation(cls, ns)
        hit = _CLASSES.setdefault(key, type(cls.__name__, bases, ns))
    return hit


def _generation(cls: type, ns: dict) -> None:
    """transformers' generate() on global tensors (`torch_generation`): beams repeat global
    tensors, a pipeline's outputs move to the ids' placement."""
    ns["_expand_inputs_for_generation"] = expanding(cls)
    if callable(getattr(cls, "generate", None)):
        ns["generate"] = generating(cls)


def _twin_call(cls: type):
    """``__call__`` of a layer taking its sf.nn twin's ``forward``: plain torch tensor arguments
    (positions, masks) are lifted onto the placement of the global ones or of the layer's
    parameters (`sbpflow.tensor.lift`) first, as torch functions do, so forward hooks and
    wrappers see global tensors; with no global tensor anywhere, torch's own ``forward``."""
    torch_forward = cls.forward

    def __call__(self, *args, **kwargs):
        values = (*args, *kwargs.values())
        if not any(isinstance(v, torch.Tensor) for v in values):
            return Module.__call__(self, *args, **kwargs)
        pl = next((v.placement for v in values if isinstance(v, GlobalTensor)), None)
        if pl is None:
            pl = next((p.placement for p in self.parameters(recurse=False)), None)
        if pl is None:
            return torch_forward(self, *args, **kwargs)
        args = tuple(lift(a, pl) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: lift(v, pl) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return Module.__call__(self, *args, **kwargs)
    return __call__


# -- converting -------------------------------------------------------------------------------------
_TORCH_INTERNALS = frozenset(torch.nn.Module().__dict__)
_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
          "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def from_torch(module, placement: Placement | None = None, *, meta: bool = False) -> Module:
    """An sbpflow model equal to the ``torch.nn.Module`` ``module`` (a new object: ``module``
    is left as it was); an `sf.nn.Module` is returned as it is.

    A collective: every rank of ``placement`` calls it, with the same model structure. The
    parameter and buffer values are those of the placement's first rank (broadcast, as DDP's
    module-state sync: `_synced_values`), so a model each rank built with its own random state
    starts the same everywhere. They are laid out replicated on ``placement`` (default: every
    rank, 1-D); `sf.parallel.apply` then lays the parameters out by rule. Names, ``state_dict``
    keys, tied parameters and modules, attributes and ``requires_grad`` are the torch model's;
    forward hooks are kept. Backward hooks are refused (`UnsupportedTorchFunction`): sbpflow's
    autograd runs on the shards. Ranks whose models differ in shapes or dtypes: `ShapeError`.
    ``meta``: tensors on torch's meta device become storage-less global tensors (for
    `sf.load_pretrained`); without it they raise `ShapeError`."""
    if isinstance(module, Module):
        return module
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sf.nn.from_torch takes a torch.nn.Module, got {type(module).__name__}")
    if placement is None:
        placement = Placement("cpu", list(range(_comm.world_size())))
    memo = {"twins": _twins(), "values": _synced_values(module, placement), "meta": meta}
    return _convert(module, placement, memo, "")


def _convert(m: torch.nn.Module, pl: Placement, memo: dict, name: str) -> Module:
    """The converted ``m`` (memo: by id, so a module or tensor used twice stays one object;
    ``memo["twins"]``: the torch classes with an sf.nn twin)."""
    hit = memo.get(id(m))
    if hit is not None:
        return hit
    if m._backward_hooks or m._backward_pre_hooks:
        raise UnsupportedTorchFunction(
            f"sf.nn.from_torch: module {name or type(m).__name__!r} has backward hooks; "
            f"remove them (sbpflow's backward runs on the shards: use forward hooks, or hooks "
            f"on the global tensors' .local)")
    twin = memo["twins"].get(type(m))
    cls = _converted_class(type(m), twin if twin is not None and _twin_fits(m) else None)
    new = object.__new__(cls)
    torch.nn.Module.__init__(new)   # torch's own attributes, for the torch methods left
    Module.__init__(new)            # the shared dicts: sf.nn.Module's
    object.__setattr__(new, "_non_persistent", new._non_persistent_buffers_set)
    memo[id(m)] = new
    for k, v in vars(m).items():
        if k not in _TORCH_INTERNALS:
            object.__setattr__(new, k, v)
    object.__setattr__(new, "training", m.training)
    object.__setattr__(new, "_sf_placement", pl)
    new._non_persistent.update(m._non_persistent_buffers_set)
    for key in _HOOKS:
        getattr(new, key).update(getattr(m, key))
    for k, p in m._parameters.items():
        new._parameters[k] = None if p is None else _tensor(p, pl, memo, True)
    for k, b in m._buffers.items():
        new._buffers[k] = None if b is None else _tensor(b, pl, memo, False)
    for k, c in m._modules.items():
        new._modules[k] = None if c is None else \
            _convert(c, pl, memo, f"{name}.{k}" if name else k)
    return new


def _tensor(t: torch.Tensor, pl: Placement, memo: dict, parameter: bool) -> GlobalTensor:
    """A torch parameter as a replicated `Parameter`, a buffer as a replicated global tensor,
    of the value ``memo["values"]`` holds for it (the first rank's) or its own (memo: a tensor
    shared by several modules stays one object). A tensor on torch's ``meta`` device (a model
    built under ``torch.device("meta")``) stays storage-less: a meta global tensor, given
    storage in its layout by `sf.parallel.apply` and values by `sf.load_pretrained`."""
    hit = memo.get(id(t))
    if hit is not None:
        return hit
    value = memo["values"].get(id(t))
    if value is None:
        value = t.detach()
    if value.is_meta:
        if not memo["meta"]:
            raise ShapeError(f"sf.nn.from_torch: a {'parameter' if parameter else 'buffer'} of "
                             f"shape {tuple(t.shape)} is on the meta device (no values); read "
                             f"a checkpoint into such a model with sf.load_pretrained(model, "
                             f"path, placement, rules), which lays it out first")
        value = meta_tensor(tuple(value.shape), pl, (B,) * pl.ndim, value.dtype)
    if parameter:
        out = Parameter(value, requires_grad=t.requires_grad, placement=pl,
                        sbp=(B,) * pl.ndim)
    elif isinstance(value, GlobalTensor):
        out = value
    else:
        out = _sf_tensor(value, pl, (B,) * pl.ndim)
    memo[id(t)] = out
    return out


# -- the values every rank starts from (DDP's module-state sync) ----------------------------------
# bytes one broadcast carries at most (DDP broadcasts module states in buckets of 250 MB): a
# bound on the extra memory a rank holds while converting, and few messages
_BUCKET_BYTES = 256 * 2**20


def _synced_values(module: torch.nn.Module, pl: Placement) -> dict:
    """``{id(tensor): value}``: on the ranks of ``pl`` but its first, the first rank's value of
    every parameter and buffer of ``module`` (views of the received bytes); empty on the first
    rank (its own values are the ones) and where there is nothing to agree on.

    Why: each rank converts its own torch model; one built on each rank (torchrun without a
    seed; `sf.launch` rank threads, which share torch's random generator) differs across
    ranks, and replicated or split parameters would silently disagree. Cost: a 24-byte
    all-gather of the models' shapes (counted as "meta") and one broadcast per
    `_BUCKET_BYTES` of state (counted as "broadcast"); meta tensors hold no value and stay."""
    comm = _comm.current()
    group = tuple(pl.flat_ranks)
    if len(group) < 2 or comm.rank not in group:
        return {}
    tensors = [t for t in _state_tensors(module) if not t.is_meta]
    _check_same_state(comm, group, tensors, pl)
    src, values = group[0], {}
    for bucket in _buckets(tensors):
        sizes = [t.numel() * t.element_size() for t in bucket]
        if comm.rank == src:
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in bucket])
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=bucket[0].device)
        flat = comm.broadcast(flat, src, group)
        if comm.rank != src:
            for t, piece in zip(bucket, flat.split(sizes)):
                values[id(t)] = piece.view(t.dtype).view(t.shape)
    return values


def _state_tensors(module: torch.nn.Module) -> list:
    """The parameters and buffers of ``module``, each once, in module order."""
    seen, out = set(), []
    for m in module.modules():
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _buckets(tensors: list) -> list:
    """``tensors`` in broadcasts of one device each, up to `_BUCKET_BYTES` (or one tensor).
    Larger elements first in each, so every piece of the bytes starts at a multiple of its
    element size (a view as its dtype needs it)."""
    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    out = []
    for ts in by_device.values():
        ts = sorted(ts, key=lambda t: -t.element_size())   # stable: module order within a size
        bucket, size = [], 0
        for t in ts:
            n = t.numel() * t.element_size()
            if bucket and size + n > _BUCKET_BYTES:
                out.append(bucket)
                bucket, size = [], 0
            bucket.append(t)
            size += n
        if bucket:
            out.append(bucket)
    return out


def _check_same_state(comm, group: tuple, tensors: list, pl: Placement) -> None:
    """Raise `ShapeError` on every rank when the ranks' models differ in their parameters' and
    buffers' shapes or dtypes (the broadcast needs the same bytes everywhere)."""
    text = ";".join(f"{tuple(t.shape)}{t.dtype}{t.device.type}" for t in tensors)
    rows = comm.gather_ints([text_digest(text), len(tensors), sum(t.numel() for t in tensors)],
                            group)
    odd = [r for r, row in zip(group, rows) if row != rows[0]]
    if odd:
        (_, n0, e0), (_, n, e) = rows[0], rows[group.index(odd[0])]
        raise ShapeError(
            f"sf.nn.from_torch: the torch models of the ranks of {pl} differ: rank {group[0]}'s "
            f"has {n0} parameters and buffers of {e0} elements, rank {odd[0]}'s {n} of {e} "
            f"(or the same counts in other shapes, dtypes or devices; ranks {odd} differ from "
            f"rank {group[0]}); build the same model (same config, same dtype) on every rank: "
            f"its values are then taken from rank {group[0]}")
