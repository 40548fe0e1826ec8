"""``sf.nn.from_torch``: a ``torch.nn.Module`` in, an sbpflow model out.

The converted model is a new object with the torch model's structure, attribute values,
parameter names and tied parameters; the torch model is left as it was. Each module becomes an
instance of a class derived from its own torch class and from `TorchConverted` (an `sf.nn.Module`),
so ``isinstance`` against both holds and the module's own ``forward`` runs unmodified: its torch
calls reach `GlobalTensor.__torch_function__` (`torch_functions`). A torch layer with an
``sf.nn`` twin (``Linear``, ``Embedding``, ``LayerNorm``, ``Conv2d``, activations, pooling,
containers) takes the twin's ``forward`` instead (one dispatch less, and `sf.auto.trace` sees its
layers). Parameters become `Parameter` s and buffers global tensors, replicated on the placement;
lay them out afterwards with `sf.parallel.apply`. See docs/torch_models.md.
"""

from __future__ import annotations

import torch

from .. import comm as _comm
from ..placement import Placement
from ..sbp import B
from ..tensor import GlobalTensor, UnsupportedTorchFunction, _to_dtype, lift
from ..tensor import tensor as _sf_tensor
from . import modules as M
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
        hit = _CLASSES.setdefault(key, type(cls.__name__, bases, ns))
    return hit


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


def from_torch(module, placement: Placement | None = None) -> Module:
    """An sbpflow model equal to the ``torch.nn.Module`` ``module`` (a new object: ``module``
    is left as it was); an `sf.nn.Module` is returned as it is.

    Every rank calls it with the same module value. Parameters and buffers are laid out
    replicated on ``placement`` (default: every rank, 1-D); `sf.parallel.apply` then lays the
    parameters out by rule. Names, ``state_dict`` keys, tied parameters and modules, attributes
    and ``requires_grad`` are the torch model's; forward hooks are kept. Backward hooks are
    refused (`UnsupportedTorchFunction`): sbpflow's autograd runs on the shards."""
    if isinstance(module, Module):
        return module
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sf.nn.from_torch takes a torch.nn.Module, got {type(module).__name__}")
    if placement is None:
        placement = Placement("cpu", list(range(_comm.world_size())))
    return _convert(module, placement, {"twins": _twins()}, "")


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
    """A torch parameter as a replicated `Parameter`, a buffer as a replicated global tensor
    (memo: a tensor shared by several modules stays one object)."""
    hit = memo.get(id(t))
    if hit is not None:
        return hit
    value = t.detach()
    if parameter:
        out = Parameter(value, requires_grad=t.requires_grad, placement=pl,
                        sbp=(B,) * pl.ndim)
    else:
        out = _sf_tensor(value, pl, (B,) * pl.ndim)
    memo[id(t)] = out
    return out
