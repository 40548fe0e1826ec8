"""``sf.nn``'s `Module`: torch.nn's `Module` on global tensors, with torch's forward hooks
(`RemovableHandle`) and state dicts. The layers built on it are in `layers.py`.

A `Module` registers `Parameter` s and sub-modules as torch does (torch's dotted names and
state-dict keys). State dicts hold *logical* values. See docs/internals.md, 'Modules'.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Iterator, NamedTuple

import torch

from ..errors import ShapeError, StateDictError, UnsupportedTorchFunction
from ..gradsync import zero_grads
from ..param_state import mark_replaced, mark_stale
from ..sbp import format_nd_sbp
from ..tensor import GlobalTensor, module_called
from ..utils import renamed
from ..zero.pending import settle
from . import init
from .init import fill_regions_
from .parameter import Parameter

__all__ = ["Parameter", "Module", "RemovableHandle", "StateDictError"]


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class RemovableHandle:
    """What registering a forward hook returns (torch's ``RemovableHandle``): ``remove()``
    unregisters the hook (again: nothing); as a context manager it removes it on exit."""

    def __init__(self, hooks: dict, *extra: dict) -> None:
        # torch's own counter: a converted model keeps its torch hooks under torch's ids, and
        # a hook registered afterwards must not take one of them (it replaced the first)
        self.id = torch.utils.hooks.RemovableHandle.next_id
        torch.utils.hooks.RemovableHandle.next_id += 1
        self._dicts = (hooks, *extra)

    def remove(self) -> None:
        for d in self._dicts:
            d.pop(self.id, None)

    def __enter__(self) -> "RemovableHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class _IncompatibleKeys(NamedTuple):
    missing_keys: list
    unexpected_keys: list


def _add_hook(hooks: OrderedDict, hook, prepend: bool, flags: list) -> "RemovableHandle":
    """Register ``hook`` in ``hooks`` (first if ``prepend``), marking it in each flag table
    ``(table, on)`` that is on; the handle removes it from all of them."""
    handle = RemovableHandle(hooks, *(table for table, _ in flags))
    hooks[handle.id] = hook
    for table, on in flags:
        if on:
            table[handle.id] = True
    if prepend:
        hooks.move_to_end(handle.id, last=False)
    return handle


class Module:
    """Base class of sbpflow modules (torch.nn.Module's registration and traversal API)."""

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", OrderedDict())
        for key in _HOOK_DICTS:
            object.__setattr__(self, key, OrderedDict())

    def forward(self, *args, **kwargs):
        """The module's computation on global tensors (a subclass defines it); call the module, not
        ``forward``, so that hooks run."""
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args, **kwargs):
        module_called(self)   # (a graph's trace keeps the modules it ran)
        d = self.__dict__
        if not (d.get("_forward_pre_hooks") or d.get("_forward_hooks")):
            return self.forward(*args, **kwargs)
        return self._call_with_hooks(args, kwargs)

    # -- forward hooks (torch.nn.Module's protocol) ----------------------------------------------
    def register_forward_pre_hook(self, hook, *, prepend: bool = False,
                                  with_kwargs: bool = False) -> "RemovableHandle":
        """Run ``hook(module, args)`` before every ``forward``, as torch: a non-None result
        replaces the positional arguments (a non-tuple is wrapped in one). With
        ``with_kwargs=True`` it is ``hook(module, args, kwargs)`` and may return
        ``(args, kwargs)``. Hooks run in registration order; ``prepend`` puts this one first."""
        return _add_hook(self._forward_pre_hooks, hook, prepend,
                         [(self._forward_pre_hooks_with_kwargs, with_kwargs)])

    def register_forward_hook(self, hook, *, prepend: bool = False, with_kwargs: bool = False,
                              always_call: bool = False) -> "RemovableHandle":
        """Run ``hook(module, args, output)`` after every ``forward`` (``args``: what the
        pre-hooks gave ``forward``), as torch: a non-None result replaces the output. With
        ``with_kwargs=True`` it is ``hook(module, args, kwargs, output)``. ``always_call``: also
        run it (output None) when a pre-hook or ``forward`` raises; its own exception is then a
        warning and the original one propagates."""
        return _add_hook(self._forward_hooks, hook, prepend,
                         [(self._forward_hooks_with_kwargs, with_kwargs),
                          (self._forward_hooks_always_called, always_call)])

    def _refuse_backward_hook(self, *args, **kwargs):
        """Module backward hooks are not supported on global tensors (it raises, naming the
        alternative): hook the tensors instead."""
        raise UnsupportedTorchFunction(
            f"{type(self).__name__}: backward hooks on a module are not supported by sbpflow "
            f"(its backward runs on the shards, and torch's hook would silently never be "
            f"called); use a forward hook, or a hook on a global tensor's .local")
    register_full_backward_hook = register_full_backward_pre_hook = _refuse_backward_hook
    register_backward_hook = _refuse_backward_hook

    def _call_with_hooks(self, args: tuple, kwargs: dict):
        """``forward`` between the pre-hooks and the hooks; on an exception, the hooks
        registered with ``always_call`` that have not run yet run before it propagates."""
        call = {"args": args, "kwargs": kwargs, "result": None, "called": set()}
        try:
            return self._hooked_forward(call)
        except Exception:
            for hook_id, hook in list(self._forward_hooks.items()):
                if hook_id not in self._forward_hooks_always_called or hook_id in call["called"]:
                    continue
                try:
                    self._run_forward_hook(hook_id, hook, call)
                except Exception as exc:
                    warnings.warn(f"module forward hook with ``always_call=True`` raised an "
                                  f"exception that was silenced as another error was raised "
                                  f"in forward: {exc}", stacklevel=2)
            raise

    def _hooked_forward(self, call: dict):
        for hook_id, hook in list(self._forward_pre_hooks.items()):
            if hook_id in self._forward_pre_hooks_with_kwargs:
                out = hook(self, call["args"], call["kwargs"])
                if out is not None:
                    if not (isinstance(out, tuple) and len(out) == 2):
                        raise RuntimeError(f"forward pre-hook must return None or a tuple of "
                                           f"(new_args, new_kwargs), but got {out}.")
                    call["args"], call["kwargs"] = out
            else:
                out = hook(self, call["args"])
                if out is not None:
                    call["args"] = out if isinstance(out, tuple) else (out,)
        call["result"] = self.forward(*call["args"], **call["kwargs"])
        for hook_id, hook in list(self._forward_hooks.items()):
            if hook_id in self._forward_hooks_always_called:
                call["called"].add(hook_id)
            self._run_forward_hook(hook_id, hook, call)
        return call["result"]

    def _run_forward_hook(self, hook_id: int, hook, call: dict) -> None:
        if hook_id in self._forward_hooks_with_kwargs:
            out = hook(self, call["args"], call["kwargs"], call["result"])
        else:
            out = hook(self, call["args"], call["result"])
        if out is not None:
            call["result"] = out

    # -- registration --------------------------------------------------------------------------
    def _check_init(self, what: str) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"cannot assign {what} before Module.__init__() call")

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """As torch's: register ``param`` (an `sf.nn.Parameter`, or None) under ``name``."""
        self._check_init("parameters")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign {type(param).__name__} object to parameter {name!r} "
                            f"(sf.nn.Parameter or None required)")
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: GlobalTensor | None,
                        persistent: bool = True) -> None:
        """As torch's: register a global tensor (or None) as a buffer; ``persistent=False`` keeps
        it out of the state dict."""
        self._check_init("buffers")
        if tensor is not None and not isinstance(tensor, GlobalTensor):
            raise TypeError(f"cannot assign {type(tensor).__name__} object to buffer {name!r} "
                            f"(sf.GlobalTensor or None required)")
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    def add_module(self, name: str, module: "Module | None") -> None:
        """As torch's: register ``module`` (or None) as the child ``name`` (also
        `register_module`)."""
        self._check_init("child modules")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not an sf.nn.Module subclass")
        if "." in name or name == "":
            raise KeyError(f"module name can't contain '.' or be empty, got {name!r}")
        self._modules[name] = module

    register_module = add_module

    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        params, modules, buffers = d.get("_parameters"), d.get("_modules"), d.get("_buffers")
        if isinstance(value, Parameter):
            self._check_init("parameters")
            self._drop(name, keep="_parameters")
            self.register_parameter(name, value)
        elif params is not None and name in params:
            self.register_parameter(name, value)  # None or an error
        elif isinstance(value, Module):
            self._check_init("child modules")
            self._drop(name, keep="_modules")
            modules[name] = value
        elif modules is not None and name in modules:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} as child module {name!r} "
                                f"(sf.nn.Module or None expected)")
            modules[name] = None
        elif buffers is not None and name in buffers:
            if value is not None and not isinstance(value, GlobalTensor):
                raise TypeError(f"cannot assign {type(value).__name__} as buffer {name!r} "
                                f"(sf.GlobalTensor or None expected)")
            buffers[name] = value
        else:
            object.__setattr__(self, name, value)

    def _drop(self, name: str, keep: str) -> None:
        """Forget ``name`` everywhere but in ``keep`` (a re-assignment keeps its position)."""
        for key in ("_parameters", "_buffers", "_modules"):
            if key != keep:
                self.__dict__[key].pop(name, None)
        self.__dict__.pop(name, None)
        self._non_persistent.discard(name)

    def __getattr__(self, name: str) -> Any:
        d = self.__dict__
        for key in ("_parameters", "_buffers", "_modules"):
            if key in d and name in d[key]:
                return d[key][name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for key in ("_parameters", "_buffers", "_modules"):
            if name in self.__dict__.get(key, {}):
                del self.__dict__[key][name]
                self._non_persistent.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers)
                      | set(self._modules))

    # -- traversal -----------------------------------------------------------------------------
    def named_modules(self, memo: set | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, "Module"]]:
        """As torch's: ``(name, module)`` for this module and every descendant, depth first, each
        once unless ``remove_duplicate=False``."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, module in self._modules.items():
            if module is None:
                continue
            yield from module.named_modules(memo, prefix + ("." if prefix else "") + name,
                                            remove_duplicate)

    def modules(self) -> Iterator["Module"]:
        """As torch's: this module and every descendant."""
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        """As torch's: ``(name, module)`` of the direct children."""
        seen = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self) -> Iterator["Module"]:
        """As torch's: the direct children."""
        for _, m in self.named_children():
            yield m

    def _named_members(self, key: str, prefix: str, recurse: bool, remove_duplicate: bool):
        seen = set()
        mods = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse \
            else [(prefix, self)]
        for mod_prefix, mod in mods:
            for name, t in mod.__dict__[key].items():
                if t is None or (remove_duplicate and id(t) in seen):
                    continue
                seen.add(id(t))
                yield mod_prefix + ("." if mod_prefix else "") + name, t

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """``(dotted name, parameter)`` in registration order, each parameter once (shared
        parameters under their first name), as torch."""
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """As torch's: every parameter (global tensors), each once, in registration order; give
        them to an `sf.optim` optimizer."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, GlobalTensor]]:
        """As torch's: ``(name, buffer)`` of every buffer (global tensors)."""
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[GlobalTensor]:
        """As torch's: every buffer (global tensors)."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target: str) -> "Module":
        """As torch's: the descendant at the dotted path ``target`` ("" is this module)."""
        mod = self
        for item in target.split(".") if target else []:
            if item not in mod._modules or mod._modules[item] is None:
                raise AttributeError(f"{type(mod).__name__} has no submodule {item!r} "
                                     f"(looking up {target!r})")
            mod = mod._modules[item]
        return mod

    def get_parameter(self, target: str) -> Parameter:
        """As torch's: the parameter at the dotted path ``target``."""
        mod_path, _, name = target.rpartition(".")
        mod = self.get_submodule(mod_path)
        if name not in mod._parameters:
            raise AttributeError(f"{type(mod).__name__} has no parameter {name!r}")
        return mod._parameters[name]

    def apply(self, fn) -> "Module":
        """As torch's: call ``fn`` on every descendant, then on this module; returns this module."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # -- modes and grads -----------------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """As torch's: set training mode (dropout on, batch norm updates its statistics) here and
        below."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        """As torch's: ``train(False)``."""
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        """As torch's: set ``requires_grad`` of every parameter."""
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def to(self, dtype: torch.dtype) -> "Module":
        """Cast floating parameters and buffers to ``dtype`` (shard by shard, no communication;
        parameters become new leaves: build the optimizer afterwards, the step of one built
        before raises `OptimizerStateError`)."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Module.to takes a torch.dtype, got {dtype!r} (placements are "
                            f"changed with sf.parallel.apply)")
        new: dict = {}  # by id: tied parameters stay tied
        for prefix, m in self.named_modules():
            for key, p in list(m._parameters.items()):
                if p is not None and p.dtype.is_floating_point and p.dtype != dtype:
                    if id(p) not in new:
                        new[id(p)] = Parameter(
                            GlobalTensor(p.local.detach().to(dtype), tuple(p.shape),
                                         p.placement, p.sbp), requires_grad=p.requires_grad)
                        init.copy_record(p, new[id(p)])   # a meta parameter keeps its init
                        # an optimizer built before holds p: its step raises
                        mark_replaced(p, f"{prefix}.{key}" if prefix else key, "Module.to")
                    m._parameters[key] = new[id(p)]
            for key, b in list(m._buffers.items()):
                if b is not None and b.dtype.is_floating_point and b.dtype != dtype:
                    m._buffers[key] = GlobalTensor(b.local.to(dtype), tuple(b.shape),
                                                   b.placement, b.sbp)
        return self

    def double(self) -> "Module":
        """Cast every floating-point parameter and buffer to float64, in its layout."""
        return self.to(torch.float64)

    def float(self) -> "Module":
        """Cast every floating-point parameter and buffer to float32, in its layout."""
        return self.to(torch.float32)

    def bfloat16(self) -> "Module":
        """Cast every floating-point parameter and buffer to bfloat16, in its layout."""
        return self.to(torch.bfloat16)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: drop (``set_to_none=True``) or zero every parameter's gradient."""
        zero_grads(self.parameters(), set_to_none)

    # -- state dicts ---------------------------------------------------------------------------
    def _state_items(self, prefix: str = "") -> list[tuple[str, GlobalTensor]]:
        """(key, tensor) in torch's state_dict order: each module's parameters, then its
        persistent buffers, then its children's, depth first. Parameters still being gathered
        in the background (ZeRO stage 1 after a step) are waited for."""
        if not prefix:
            settle()
        out = []
        for name, p in self._parameters.items():
            if p is not None:
                out.append((prefix + name, p))
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent:
                out.append((prefix + name, b))
        for name, m in self._modules.items():
            if m is not None:
                out.extend(m._state_items(prefix + name + "."))
        return out

    def state_dict(self, *, prefix: str = "", keep_vars: bool = False) -> "OrderedDict[str, Any]":
        """The logical values as plain torch tensors (detached copies), with torch's keys.

        A collective (each tensor is gathered whole): every rank must call it. With
        ``keep_vars=True`` the global tensors themselves, without communication."""
        out = OrderedDict()
        for key, t in self._state_items(prefix):
            out[key] = t if keep_vars else t.full_tensor().detach().clone()
        return out

    def to_torch_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """A state dict a ``torch.nn`` twin of this model loads with ``load_state_dict``
        (logical values; a collective, as `state_dict`)."""
        return self.state_dict()

    def load_state_dict(self, state_dict, strict: bool = True) -> _IncompatibleKeys:
        """Load logical values: plain torch tensors (each rank keeps its shard of the value,
        no communication; the value must be the same on every rank) or global tensors (boxed
        to each parameter's layout: a collective).

        Shapes are checked first and all mismatches raised together as `sf.ShapeError`
        (nothing is loaded then). ``strict``: missing or unexpected keys raise
        `StateDictError`. Returns ``(missing_keys, unexpected_keys)`` as torch."""
        items = self._state_items()
        expected = {k for k, _ in items}
        missing = [k for k, _ in items if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        bad = []
        for key, t in items:
            if key not in state_dict:
                continue
            v = state_dict[key]
            if not isinstance(v, (torch.Tensor, GlobalTensor)):
                bad.append(f"{key}: expected a tensor, got {type(v).__name__}")
            elif tuple(v.shape) != tuple(t.shape):
                bad.append(f"{key}: the state dict has shape {tuple(v.shape)} but the module's "
                           f"tensor has shape {tuple(t.shape)} (placement {t.placement}, sbp "
                           f"{format_nd_sbp(t.sbp)})")
        if bad:
            raise ShapeError("load_state_dict: " + "; ".join(bad))
        if strict and (missing or unexpected):
            raise StateDictError(f"load_state_dict into {type(self).__name__}: missing keys "
                                 f"{missing}, unexpected keys {unexpected}")
        for key, t in items:
            if key in state_dict:
                assign_logical(t, state_dict[key])
        return _IncompatibleKeys(missing, unexpected)

    # -- display -------------------------------------------------------------------------------
    def extra_repr(self) -> str:
        """The module's own settings in its ``repr`` (a subclass overrides it), as torch's."""
        return ""

    def __repr__(self) -> str:
        lines = []
        for name, m in self._modules.items():
            sub = repr(m).replace("\n", "\n  ")
            lines.append(f"({name}): {sub}")
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        body = ([extra] if extra else []) + lines
        return f"{type(self).__name__}(\n  " + "\n  ".join(body) + "\n)"


def assign_logical(t: GlobalTensor, value) -> None:
    """Overwrite ``t``'s shard in place with its part of the logical ``value`` (a torch tensor
    the same on every rank, or a global tensor: boxed to ``t``'s layout, a collective). A
    ``t`` without storage (`sf.nn.init.meta_init`) records the assignment for when it is
    materialised (``value`` is kept until then)."""
    if t.local.is_meta:
        init.record(t, lambda m: assign_logical(m, value))
        return
    mark_stale(t)   # a ZeRO-2 parameter's whole copy is gathered again before its next use
    if isinstance(value, GlobalTensor):
        if tuple(value.shape) != tuple(t.shape):
            raise ShapeError(f"cannot assign a tensor of shape {tuple(value.shape)} to one of "
                             f"shape {tuple(t.shape)} on {t.placement} with sbp "
                             f"{format_nd_sbp(t.sbp)}")
        local = value.detach().to_global(t.placement, t.sbp).local
        with torch.no_grad():
            t.local.copy_(local)
        return
    full = value.detach()
    fill_regions_(t, lambda box: full[tuple(slice(s, s + n) for s, n in box)])


# the layers moved to `layers.py` (issue 37): ``sbpflow.nn.modules.Linear`` and the others still
# resolve there, for imports and pickles that name them, for one release
_MOVED_TO_LAYERS = ("Linear", "Embedding", "LayerNorm", "Dropout", "GELU", "ReLU", "Tanh",
                    "Sigmoid", "SiLU", "Identity", "Softmax", "CrossEntropyLoss", "Conv2d",
                    "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "Flatten", "Sequential",
                    "ModuleList", "ModuleDict")
__getattr__ = renamed(__name__, {name: f"sbpflow.nn.layers:{name}" for name in _MOVED_TO_LAYERS})
