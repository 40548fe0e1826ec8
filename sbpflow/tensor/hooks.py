"""What the layers above reach a global tensor's ops through, and what they are told of.

The nn layer installs how torch functions run on global tensors (`set_torch_dispatch`); the
graph sets a recorder on the thread that traces a step (`set_recorder`), which every op,
boxing, creation and backward tells of (sbpflow.graph.recorder). A lower layer cannot import
those: it only calls what it was given. (Re-split watching: tensor/resplits.py.)
"""

from __future__ import annotations

import contextlib
import threading

from ..errors import UnsupportedTorchFunction

__all__ = ["set_torch_dispatch", "recording", "set_recorder", "current_recorder", "errors_as",
           "error_rule", "source", "module_called", "guard", "fresh"]


# -- torch functions on global tensors ----------------------------------------------------------
# ``torch.*``, ``torch.nn.functional.*`` and Tensor methods called with a global tensor reach
# `GlobalTensor.__torch_function__`, which hands them to the dispatcher the nn layer installs
# (sbpflow/nn/torch_functions.py: the table of torch functions and their sbpflow versions). A
# lower layer cannot import nn: it only calls what it was given, as with the graph recorder.
class _TorchHooks:
    dispatch = None  # dispatch(func, args, kwargs)


def set_torch_dispatch(dispatch) -> None:
    """Install ``dispatch(func, args, kwargs)``: how torch functions run on global tensors."""
    _TorchHooks.dispatch = dispatch


def _torch_dispatch(func, args: tuple, kwargs: dict):
    dispatch = _TorchHooks.dispatch
    if dispatch is None:  # sbpflow.nn not imported (it always is through ``import sbpflow``)
        raise UnsupportedTorchFunction(f"{getattr(func, '__name__', func)}: torch functions on "
                                       f"global tensors need sbpflow.nn imported")
    return dispatch(func, args, kwargs)


# -- graph tracing hooks -------------------------------------------------------------------------
# While `sf.nn.Graph` traces ``build`` on a thread, the recorder set here is told of every op,
# boxing, detach, creation and backward (sbpflow.graph.trace: what it keeps and why). A lower
# layer cannot import the graph: it only calls the recorder it was given.
class _Tracing(threading.local):
    recorder = None
    translate = None  # the rule `errors_as` set: kept with the ops a graph records


_tracing = _Tracing()


def recording() -> bool:
    """Whether this thread is tracing a graph (eager shortcuts that the graph cannot replay,
    such as a mean whose count is still in flight, are then not taken)."""
    return _tracing.recorder is not None


def set_recorder(recorder):
    """Make ``recorder`` this thread's graph recorder (None: stop); returns the previous one."""
    previous, _tracing.recorder = _tracing.recorder, recorder
    return previous


def current_recorder():
    """This thread's graph recorder (None when not tracing)."""
    return _tracing.recorder


@contextlib.contextmanager
def errors_as(translate):
    """Inside the block, an exception an op raises becomes ``translate(exc)`` when that is not
    None (e.g. torch's IndexError as an `IndexOutOfRange` naming the layouts). A graph keeps
    the rule with the ops it records there, so a replay raises what eager raises."""
    previous, _tracing.translate = _tracing.translate, translate
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the rule decides; others re-raised as they are
        new = translate(exc)
        if new is None:
            raise
        raise new from None
    finally:
        _tracing.translate = previous


def error_rule():
    """The `errors_as` rule in force on this thread (None: none)."""
    return _tracing.translate


def source(load):
    """``load()``: the next batch of a data source (a tuple of global tensors, or one). A graph
    calls ``load`` once per call, in a loading actor, and hands each micro-batch its rows."""
    rec = _tracing.recorder
    return load() if rec is None else rec.source(load)


def module_called(module) -> None:
    """``module``'s forward runs (a graph's trace keeps the modules it ran: their train / eval
    modes are part of what the graph was compiled for)."""
    rec = _tracing.recorder
    if rec is not None:
        rec.module(module)


def guard(t: "GlobalTensor", check) -> None:
    """Run ``check(t.local)`` (it raises on bad values, e.g. an index out of range); a graph runs
    it again on every replay, since the values change while the traced ops stay."""
    check(t._local)
    rec = _tracing.recorder
    if rec is not None:
        rec.guard(t, check)


def fresh(make) -> "GlobalTensor":
    """``make()``, a tensor that a graph recomputes on every replay instead of keeping it as a
    constant (a random value drawn from the default seed stream, a dropout seed)."""
    t = make()
    rec = _tracing.recorder
    if rec is not None:
        rec.thunk(t, lambda: make()._local)
    return t
