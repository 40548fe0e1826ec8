"""Custom ``torch.autograd.Function``s called with global tensors (BLOOM's ``GeLUFunction``,
straight-through estimators, fused kernels' Python twins).

Torch runs a Function's ``forward`` with grad off and ties only plain-tensor outputs to its
``backward``: a global tensor's result would leave the autograd graph, its inputs' gradients
silently missing. `install` wraps ``torch.autograd.Function.apply`` so that a call with a
global tensor among its arguments runs the Function as an op: its ``forward`` on the global
tensors (their shards' kernels recorded by nothing), its ``backward`` on global gradients when
torch's backward reaches it, through a bridge Function over the local shards. Each output's
gradient arrives in the dual of its layout; each input's gradient is boxed to the dual of the
input's. Calls without global tensors run torch's own ``apply``; torch's reentrant checkpoint
runs as its non-reentrant one (the same gradients). Refused in a graph's build (the replay
would not call ``backward``). See docs/torch_models.md, 'What runs'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint
from torch.autograd.function import _is_setup_context_defined

from ..sbp import dual_nd
from ..tensor import GlobalTensor, UnsupportedTorchFunction, recording

__all__ = ["install", "apply_on_global"]

_TORCH_APPLY = torch.autograd.Function.apply.__func__


class GlobalFunctionCtx:
    """The ``ctx`` a custom Function's ``forward`` and ``backward`` see for global tensors:
    ``save_for_backward`` / ``saved_tensors``, ``needs_input_grad``,
    ``mark_non_differentiable``, ``set_materialize_grads`` and any attribute, as torch's."""

    def __init__(self, needs_input_grad: tuple) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple = ()
        self.materialize_grads = True
        self.non_differentiable: set = set()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors) -> None:
        pass    # forward-mode AD does not run on global tensors

    def mark_non_differentiable(self, *outputs) -> None:
        self.non_differentiable.update(id(o) for o in outputs)

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = bool(value)

    def mark_dirty(self, *tensors) -> None:
        raise UnsupportedTorchFunction(
            "a custom torch.autograd.Function that writes into its global-tensor inputs "
            "(ctx.mark_dirty) is not supported: return a new tensor instead")


class _Bridge(torch.autograd.Function):
    """Local shards in, local shards out; ``state`` runs the user's Function on the global
    tensors and keeps what its backward needs."""

    @staticmethod
    def forward(ctx, state, *locals_):
        outs = state.run_forward()
        ctx.state = state
        ctx.mark_non_differentiable(*[o for o, keep in zip(outs, state.differentiable)
                                      if not keep])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.state.run_backward(grads))


class _State:
    """One call of a custom Function on global tensors: its arguments, ctx and outputs."""

    def __init__(self, cls, args: tuple, kwargs: dict) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs
        self.inputs = [a for a in args if isinstance(a, GlobalTensor)]
        self.ctx = GlobalFunctionCtx(tuple(isinstance(a, (GlobalTensor, torch.Tensor))
                                           and a.requires_grad for a in args))
        self.result: Any = None
        self.outputs: list = []          # the global tensors among the results, in order
        self.differentiable: list = []

    def run_forward(self) -> list:
        cls, ctx = self.cls, self.ctx
        if _is_setup_context_defined(cls.setup_context):
            result = cls.forward(*self.args, **self.kwargs)
            cls.setup_context(ctx, self.args, result)
        else:
            result = cls.forward(ctx, *self.args, **self.kwargs)
        self.result = result
        items = result if isinstance(result, tuple) else (result,)
        self.outputs = [o for o in items if isinstance(o, GlobalTensor)]
        self.differentiable = [id(o) not in ctx.non_differentiable and o.dtype.is_floating_point
                               for o in self.outputs]
        return [o.local for o in self.outputs]

    def run_backward(self, grads: tuple) -> list:
        """The user's ``backward`` on the outputs' gradients (each in the dual of its output's
        layout), then each input's gradient boxed to the dual of the input's layout."""
        glob = iter(GlobalTensor(g, tuple(o.shape), o.placement, dual_nd(o.sbp))
                    if g is not None else None for o, g in zip(self.outputs, grads))
        items = self.result if isinstance(self.result, tuple) else (self.result,)
        per_item = [next(glob) if isinstance(o, GlobalTensor) else None for o in items]
        got = self.cls.backward(self.ctx, *per_item)
        got = got if isinstance(got, tuple) else (got,)
        out = []
        for a, g in zip(self.args, got):
            if not isinstance(a, GlobalTensor):
                continue
            if g is None or not a.requires_grad:
                out.append(None)
                continue
            if not isinstance(g, GlobalTensor):
                raise UnsupportedTorchFunction(
                    f"{self.cls.__name__}.backward returned a {type(g).__name__} as the "
                    f"gradient of a global tensor of shape {tuple(a.shape)}: return a global "
                    f"tensor (computed from the global gradients it is given)")
            out.append(g.to(a.dtype).to_global(a.placement, dual_nd(a.sbp)).local)
        return out + [None] * (len(self.inputs) - len(out))


def apply_on_global(cls, args: tuple, kwargs: dict):
    """``cls.apply(*args, **kwargs)`` for a custom Function with global tensors among ``args``:
    its forward and backward on the global tensors (module docstring); the results as its
    forward returned them, the global tensors tied to its backward."""
    if cls is _checkpoint.CheckpointFunction:   # checkpoint(use_reentrant=True): its backward
        run, preserve, *rest = args              # keeps plain tensors only; same gradients
        return _checkpoint.checkpoint(run, *rest, use_reentrant=False,
                                      preserve_rng_state=preserve)
    if recording():
        raise UnsupportedTorchFunction(
            f"the custom torch.autograd.Function {cls.__name__} cannot be part of a graph on "
            f"global tensors (the replay would skip its backward): call it outside the "
            f"graph's build, or write its forward with torch functions only")
    state = _State(cls, args, kwargs)
    locals_ = _Bridge.apply(state, *[t.local for t in state.inputs])
    locals_ = locals_ if isinstance(locals_, tuple) else (locals_,)
    made = {id(o): GlobalTensor(loc, tuple(o.shape), o.placement, o.sbp)
            for o, loc in zip(state.outputs, locals_)}
    if not isinstance(state.result, tuple):
        return made.get(id(state.result), state.result)
    return tuple(made.get(id(o), o) if isinstance(o, GlobalTensor) else o
                 for o in state.result)


def _apply(cls, *args, **kwargs):
    if any(isinstance(a, GlobalTensor) for a in args) or \
            any(isinstance(v, GlobalTensor) for v in kwargs.values()):
        return apply_on_global(cls, args, kwargs)
    return _TORCH_APPLY(cls, *args, **kwargs)


def install() -> None:
    """Route ``torch.autograd.Function.apply`` calls with global tensors to `apply_on_global`
    (once; calls without global tensors run torch's own)."""
    if torch.autograd.Function.__dict__["apply"].__func__ is not _apply:
        torch.autograd.Function.apply = classmethod(_apply)
