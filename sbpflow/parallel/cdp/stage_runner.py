"""Running one stage module with a given parameter version, on one rank.

A version is a list of torch tensors: the stage's parameters (autograd leaves, never changed
in place), then its buffers. `StageRunner.forward` puts them into the module as global tensors
on the rank's own placement for the call (under a lock: rank threads may share the module),
the buffers as copies, runs it on the rank's input and returns what the call changed in the
buffers (batch norm's running statistics); `backward` returns the gradients of the input and
of the parameters (``torch.autograd.grad``: nothing accumulates into ``.grad``, so one
version serves several micro-batches at once). A stage whose call is local kernels only runs
them directly after one trace (`stage_program`), without the module or sbpflow's dispatch.
`probe` gives a stage's output shape on meta tensors, `trace` each sub-module's. See
docs/cdp.md, 'Stages'.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Sequence

import torch

try:  # what torch.autograd.grad calls after checking its arguments (torch 2.x)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - another torch: autograd.grad itself
    _engine_run_backward = None

from ...errors import PlanError, ShapeError
from ...nn.modules import Module
from ...placement import Placement
from ...sbp import B
from ...tensor import GlobalTensor
from .stage_program import StageTape, trace

__all__ = ["StageRunner"]

_LOCKS: "weakref.WeakKeyDictionary[Module, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock_of(module: Module) -> threading.Lock:
    """The lock of the tensors ``module`` swaps: keyed by its first sub-module holding
    parameters or buffers, so stages cut by ``split=`` from one shared Sequential (a new
    container on each rank around the same layers) share it too."""
    module = next((m for _, m in module.named_modules() if m._parameters or m._buffers),
                  module)
    with _LOCKS_GUARD:
        lock = _LOCKS.get(module)
        if lock is None:
            lock = _LOCKS[module] = threading.Lock()
        return lock


def _wrap(t: torch.Tensor, pl: Placement) -> GlobalTensor:
    return GlobalTensor(t, tuple(t.shape), pl, (B,))


def _check_scalar(loss: Callable, out: GlobalTensor, x: torch.Tensor) -> None:
    if out.local.numel() != 1:
        name = getattr(loss, "__qualname__", repr(loss))
        raise ShapeError(f"CDP loss_fn {name} returned a tensor of shape {tuple(out.shape)} "
                         f"(the last stage's input {tuple(x.shape)}), not a scalar: it must "
                         f"give the micro-batch's mean loss (e.g. reduction='mean', not "
                         f"'none')")


class StageRunner:
    """Stage ``index`` (``module``): its parameters in ``named_parameters`` order, then its
    buffers in ``named_buffers`` order (``names``, ``shapes``, ``dtypes``; the first
    ``nparams`` are parameters), and where each sits in the module tree."""

    def __init__(self, module: Module, index: int, programs: bool = True) -> None:
        self.module, self.index = module, index
        # whether calls of local kernels only replay them (`forward`); the closed-form
        # reference runs every call eagerly
        self.programs = programs
        self.tapes: dict = {}
        # the module tree's part of `modes`, kept during a trainer's run (`cache_modes`)
        self.caching, self.tree = False, None
        self.names, self.shapes, self.dtypes = [], [], []
        position: dict[int, int] = {}
        self.lock = _lock_of(module)
        with self.lock:  # another rank thread's call may have its version put in
            params = list(module.named_parameters())
            named = params + list(module.named_buffers())
            mods = [m for _, m in module.named_modules()]
            tensors = [(m, list(m._parameters.items()), list(m._buffers.items()))
                       for m in mods]
        self.nparams = len(params)
        self.modules = mods
        for name, p in named:
            position[id(p)] = len(self.names)
            self.names.append(name)
            self.shapes.append(tuple(p.shape))
            self.dtypes.append(p.dtype)
        # (sub-module, attribute, tensor index), shared tensors at every place they sit
        self.slots = [(m, attr, position[id(p)]) for m, ps, _ in tensors
                      for attr, p in ps if p is not None]
        self.buffer_slots = [(m, attr, position[id(b)]) for m, _, bs in tensors
                             for attr, b in bs if b is not None]

    def initial(self) -> list[torch.Tensor]:
        """The parameters' and buffers' logical values (``full_tensor``: a collective on their
        placement; every rank calls it in the same order)."""
        with self.lock:  # not while another rank thread's call has its version put in
            named = list(self.module.named_parameters()) + list(self.module.named_buffers())
        return [p.full_tensor().detach().clone() for _, p in named]

    def version(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` made a version: the parameters autograd leaves that require grad."""
        return [t.requires_grad_(True) if k < self.nparams else t
                for k, t in enumerate(tensors)]

    @contextlib.contextmanager
    def _put_in(self, wrapped: list, copies: dict):
        """The module with ``wrapped`` as its parameters and ``copies`` as its buffers (by
        tensor index), under the stage's lock; the module's own put back after."""
        with self.lock:
            old = [m._parameters[attr] for m, attr, _ in self.slots]
            old_b = [m._buffers[attr] for m, attr, _ in self.buffer_slots]
            for m, attr, k in self.slots:
                m._parameters[attr] = wrapped[k]
            for m, attr, k in self.buffer_slots:
                m._buffers[attr] = copies[k]
            try:
                yield
            finally:
                for (m, attr, _), p in zip(self.slots, old):
                    m._parameters[attr] = p
                for (m, attr, _), b in zip(self.buffer_slots, old_b):
                    m._buffers[attr] = b

    def _call(self, tensors: Sequence[torch.Tensor], pl: Placement, fn: Callable
              ) -> tuple[object, list[torch.Tensor]]:
        np_ = self.nparams
        wrapped = [_wrap(t, pl) for t in tensors[:np_]]
        before = list(tensors[np_:])
        copies = {k: _wrap(before[k - np_].detach().clone(), pl)
                  for k in {k for _, _, k in self.buffer_slots}}
        with self._put_in(wrapped, copies):
            out = fn()
            # a module may replace a buffer (batch norm moves it beside its input)
            after = {k: m._buffers[attr] for m, attr, k in self.buffer_slots}
        changes = [after[np_ + k].local.detach() - b.detach() for k, b in enumerate(before)]
        return out, changes

    def modes(self, device_type: str) -> tuple:
        """What besides the input decides whether a call replays its kernels (`_tape`): the
        sub-modules' train / eval modes and forward hooks (kept during a run: `cache_modes`),
        grad mode and autocast."""
        return (*self._tree(), torch.is_grad_enabled(), torch.is_autocast_enabled(device_type))

    def _tree(self) -> tuple[tuple[bool, ...], bool]:
        """The module tree's part of `modes`: each sub-module's train mode, and whether any
        has a forward hook."""
        tree = self.tree
        if tree is None:
            mods = self.modules
            tree = (tuple([m.training for m in mods]),
                    any([m.__dict__.get("_forward_hooks") or m.__dict__.get("_forward_pre_hooks")
                         for m in mods]))
            if self.caching:
                self.tree = tree
        return tree

    def cache_modes(self, on: bool) -> None:
        """Keep the module tree's modes and hooks from their first reading (``on``: a run of
        the trainer begins, in which only a call of the module itself, which drops them, runs
        code that could change them) or read them at every call (off: it ended)."""
        self.caching, self.tree = on, None

    def _tape(self, x: torch.Tensor, pl: Placement, loss: Callable | None,
              y: torch.Tensor | None) -> StageTape | None:
        """The stage's recorded kernels for a call like this one (`stage_program`): traced
        on meta tensors the first time, per input shape, dtype and grad, loss, train / eval
        modes and grad mode; None where the stage has buffers (their changes are read from
        the module), forward hooks (a replay would skip them), under autocast, or where the
        trace found more than local kernels."""
        if not self.programs or len(self.names) != self.nparams:
            return None
        training, hooked = self._tree()
        if hooked or torch.is_autocast_enabled(pl.device_type):
            return None
        # (a torch.Size hashes and compares as the tuple of its sizes)
        key = (x.shape, x.dtype, x.requires_grad, loss,
               None if y is None else (y.shape, y.dtype), torch.is_grad_enabled(), training)
        tape = self.tapes.get(key, False)
        if tape is False:
            def meta(shape, dtype, grad: bool) -> torch.Tensor:
                return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(grad)
            ins = [meta(x.shape, x.dtype, x.requires_grad)]
            ins += [meta(s, d, True) for s, d in zip(self.shapes, self.dtypes)]
            ins += [] if y is None else [meta(y.shape, y.dtype, False)]
            wrapped = [_wrap(t, pl) for t in ins]  # (before the trace: made outside the ops)
            with self._put_in(wrapped[1:1 + self.nparams], {}):
                tape = trace(self._runner(wrapped[0], loss, wrapped[-1] if y is not None
                                          else None), ins, pl.device_type)
            tape = self.tapes[key] = tape if tape.usable else None
        return tape

    def _runner(self, x: GlobalTensor, loss: Callable | None, y: GlobalTensor | None
                ) -> Callable[[], GlobalTensor]:
        """The stage's call on ``x`` (with ``loss``: ``loss(output, y)``), checked."""
        def run() -> GlobalTensor:
            out = self.module(x)
            if loss is not None:
                out = loss(out, y)
            if not isinstance(out, GlobalTensor):
                raise PlanError(f"CDP stage {self.index} returned {type(out).__name__}, not "
                                f"an sf.GlobalTensor")
            if loss is not None:
                _check_scalar(loss, out, x.local)
            return out
        return run

    def forward(self, tensors: Sequence[torch.Tensor], x: torch.Tensor, pl: Placement,
                loss: Callable | None = None, y: torch.Tensor | None = None,
                eager: Callable[[], contextlib.AbstractContextManager] | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The stage's output on input ``x`` with version ``tensors`` (local tensors); with
        ``loss`` (the last stage), ``loss(output, y)`` instead: a scalar. Also returns the
        change the call made to each buffer (new value minus the version's). A stage whose
        call is local kernels only runs them directly (`_tape`), once its first real call's
        eager output equalled the replay's. ``eager()``: the block a call that does not
        replay runs in."""
        tape = None if x.is_meta else self._tape(x, pl, loss, y)
        ins = [x, *tensors] + ([] if y is None else [y])
        if tape is not None and tape.checked:
            return tape.replay(ins), []
        run = self._runner(_wrap(x, pl), loss, None if y is None else _wrap(y, pl))
        with eager() if eager is not None else contextlib.nullcontext():
            out, changes = self._call(tensors, pl, run)
        self.tree = None  # (the module's own code ran)
        out = out.local
        if tape is not None:  # the first real call: the replay must give the same values
            with torch.no_grad():
                tape.checked = torch.equal(tape.replay(ins), out.detach())
            if not tape.checked:
                self.tapes = {k: None for k in self.tapes}  # eager from now on
                self.programs = False
        return out, changes

    @staticmethod
    def backward(out: torch.Tensor, grad_out: torch.Tensor | None,
                 inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of ``inputs`` (the stage's input, then its parameters) from ``out`` seeded
        with ``grad_out`` (None: a scalar loss, seeded with 1). An input the output does not
        depend on gets zeros."""
        if grad_out is None and out.requires_grad and out.numel() == 1:
            grad_out = torch.ones_like(out)  # (a loss: autograd.grad's seed of a scalar)
        if grad_out is None or _engine_run_backward is None:  # (torch says what is wrong)
            grads = torch.autograd.grad([out], list(inputs),
                                        None if grad_out is None else [grad_out],
                                        allow_unused=True)
        else:  # what autograd.grad calls, without its checks of the arguments' shapes and
            # tensor subclasses (the gradient of this stage's own output): 5 µs less a call
            grads = _engine_run_backward((out,), (grad_out,), False, False, tuple(inputs),
                                         True, accumulate_grad=False)
        return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]

    def trace(self, shape: Sequence[int], dtype: torch.dtype, pl: Placement
              ) -> list[tuple[Module, tuple]]:
        """Each call of the stage's sub-modules (the stage included) in the order they
        returned, with its output shape, for an input of ``shape`` / ``dtype`` (meta tensors:
        nothing is computed). Forward hooks record them; they are added and removed under
        the stage's lock, so another thread's call of the module never sees them."""
        metas = [torch.empty(s, dtype=d, device="meta") for s, d in zip(self.shapes,
                                                                       self.dtypes)]
        x = torch.empty(tuple(shape), dtype=dtype, device="meta")
        calls: list[tuple[Module, tuple]] = []

        def record(module, _args, out) -> None:
            if isinstance(out, GlobalTensor):
                calls.append((module, tuple(out.shape)))

        def run():
            handles = [m.register_forward_hook(record) for _, m in self.module.named_modules()]
            try:
                return self.module(_wrap(x, pl))
            finally:
                for h in handles:
                    h.remove()
        with torch.no_grad():
            self._call(metas, pl, run)
        return calls

    def probe(self, shape: Sequence[int], dtype: torch.dtype, pl: Placement
              ) -> tuple[tuple, torch.dtype]:
        """The stage's output shape and dtype for an input of ``shape`` / ``dtype`` (meta
        tensors: nothing is computed)."""
        metas = [torch.empty(s, dtype=d, device="meta") for s, d in zip(self.shapes,
                                                                       self.dtypes)]
        x = torch.empty(tuple(shape), dtype=dtype, device="meta")
        with torch.no_grad():
            out, _ = self.forward(metas, x, pl)
        return tuple(out.shape), out.dtype
