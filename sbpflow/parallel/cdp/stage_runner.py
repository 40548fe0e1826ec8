"""Running one stage module with a given parameter version, on one rank.

A version is a list of torch tensors, one a parameter of the stage (autograd leaves, never
changed in place). `StageRunner.forward` puts them into the module as global tensors on the
rank's own placement for the call (under a lock: rank threads may share the module) and runs
it on the rank's input; `backward` returns the gradients of the input and of the version's
tensors (``torch.autograd.grad``: nothing accumulates into ``.grad``, so one version serves
several micro-batches at once). `probe` gives a stage's output shape on meta tensors.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Sequence

import torch

from ...errors import PlanError
from ...nn.modules import Module
from ...placement import Placement
from ...sbp import B
from ...tensor import GlobalTensor

__all__ = ["StageRunner"]

_LOCKS: "weakref.WeakKeyDictionary[Module, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock_of(module: Module) -> threading.Lock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = threading.Lock()
        return lock


def _wrap(t: torch.Tensor, pl: Placement) -> GlobalTensor:
    return GlobalTensor(t, tuple(t.shape), pl, (B,))


class StageRunner:
    """Stage ``index`` (``module``): its parameters in ``named_parameters`` order (``names``,
    ``shapes``, ``dtypes``) and where each sits in the module tree."""

    def __init__(self, module: Module, index: int) -> None:
        self.module, self.index = module, index
        self.names, self.shapes, self.dtypes = [], [], []
        position: dict[int, int] = {}
        for name, p in module.named_parameters():
            position[id(p)] = len(self.names)
            self.names.append(name)
            self.shapes.append(tuple(p.shape))
            self.dtypes.append(p.dtype)
        # (sub-module, attribute, parameter index), shared parameters at every place they sit
        self.slots = [(m, attr, position[id(p)]) for _, m in module.named_modules()
                      for attr, p in m._parameters.items() if p is not None]
        bufs = [n for n, _ in module.named_buffers()]
        if bufs:
            raise PlanError(f"CDP stage {index} has buffers {bufs}: a stage's state must be "
                            f"its parameters (versions are stashed per micro-batch)")
        self.lock = _lock_of(module)

    def initial(self) -> list[torch.Tensor]:
        """The parameters' logical values (``full_tensor``: a collective on their placement;
        every rank calls it in the same order)."""
        return [p.full_tensor().detach().clone() for _, p in self.module.named_parameters()]

    def _call(self, tensors: Sequence[torch.Tensor], pl: Placement, fn: Callable):
        wrapped = [_wrap(t, pl) for t in tensors]
        with self.lock:
            old = [m._parameters[attr] for m, attr, _ in self.slots]
            for m, attr, k in self.slots:
                m._parameters[attr] = wrapped[k]
            try:
                return fn()
            finally:
                for (m, attr, _), p in zip(self.slots, old):
                    m._parameters[attr] = p

    def forward(self, tensors: Sequence[torch.Tensor], x: torch.Tensor, pl: Placement,
                loss: Callable | None = None, y: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's output on input ``x`` with parameters ``tensors`` (local tensors);
        with ``loss`` (the last stage), ``loss(output, y)`` instead: a scalar."""
        def run():
            out = self.module(_wrap(x, pl))
            if loss is not None:
                out = loss(out, _wrap(y, pl))
            if not isinstance(out, GlobalTensor):
                raise PlanError(f"CDP stage {self.index} returned {type(out).__name__}, not "
                                f"an sf.GlobalTensor")
            return out.local
        return self._call(tensors, pl, run)

    @staticmethod
    def backward(out: torch.Tensor, grad_out: torch.Tensor | None,
                 inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of ``inputs`` (the stage's input, then its parameters) from ``out`` seeded
        with ``grad_out`` (None: a scalar loss, seeded with 1). An input the output does not
        depend on gets zeros."""
        grads = torch.autograd.grad([out], list(inputs),
                                    None if grad_out is None else [grad_out],
                                    allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]

    def probe(self, shape: Sequence[int], dtype: torch.dtype, pl: Placement
              ) -> tuple[tuple, torch.dtype]:
        """The stage's output shape and dtype for an input of ``shape`` / ``dtype`` (meta
        tensors: nothing is computed)."""
        metas = [torch.empty(s, dtype=d, device="meta") for s, d in zip(self.shapes,
                                                                       self.dtypes)]
        x = torch.empty(tuple(shape), dtype=dtype, device="meta")
        with torch.no_grad():
            out = self.forward(metas, x, pl)
        return tuple(out.shape), out.dtype
