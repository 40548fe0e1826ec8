"""Forward hooks of `sf.nn.Module` follow torch.nn.Module's protocol: the same script of
registrations, calls and removals gives the same events, arguments, outputs and errors on an
sf module and on a torch module (pre-hooks with and without kwargs, replaced arguments, a
non-tuple result wrapped, prepend, forward hooks replacing the output, ``always_call`` on an
exception, handles removing once and as context managers)."""

import warnings

import pytest
import torch

import sbpflow as sf


def _module(base):
    class Echo(base):
        def __init__(self):
            super().__init__()
            self.fail = False

        def forward(self, *args, **kwargs):
            if self.fail:
                raise ValueError("forward failed")
            return ("out", args, tuple(sorted(kwargs.items())))

    return Echo()


def _script(base) -> list:
    """Registrations and calls on a fresh module of ``base``; every observable result."""
    m, log = _module(base), []
    h1 = m.register_forward_pre_hook(lambda mod, args: log.append(("pre1", args)))
    h2 = m.register_forward_pre_hook(lambda mod, args: args + ("added",))
    m.register_forward_pre_hook(lambda mod, args: log.append(("first", args)) or "single",
                                prepend=True)
    h4 = m.register_forward_pre_hook(
        lambda mod, args, kwargs: (args + ("kw",), {**kwargs, "k": 1}), with_kwargs=True)
    h5 = m.register_forward_hook(lambda mod, args, out: log.append(("post", args, out)))
    h6 = m.register_forward_hook(lambda mod, args, kwargs, out: ("replaced", out, kwargs),
                                 with_kwargs=True)
    log.append(("result", m(1, 2, z=3)))
    h2.remove()
    h2.remove()                      # a second remove does nothing
    log.append(("result", m(4)))
    for h in (h1, h4, h5, h6):
        h.remove()
    with m.register_forward_hook(lambda mod, args, out: log.append(("ctx", out))):
        log.append(("result", m(5)))
    log.append(("result", m(6)))     # the context manager removed its hook
    return log


def test_hooks_follow_torch():
    assert _script(sf.nn.Module) == _script(torch.nn.Module)


def _failing(base) -> list:
    m, log = _module(base), []
    m.register_forward_hook(lambda mod, args, out: log.append(("always", args, out)),
                            always_call=True)
    m.register_forward_hook(lambda mod, args, out: log.append(("not on error", out)))

    def broken(mod, args, out):
        raise KeyError("hook failed")
    m.register_forward_hook(broken, always_call=True)
    m.register_forward_pre_hook(lambda mod, args: args + ("pre",))
    m.fail = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="forward failed"):
            m(1)
    log.append([str(w.message).split(":")[0] for w in caught])
    m.fail = False
    with pytest.raises(KeyError, match="hook failed"):   # no error in forward: it propagates
        m(2)
    log.append(len([e for e in log if e[0] == "always"]))
    m2 = _module(base)
    m2.register_forward_pre_hook(lambda mod, args, kwargs: "bad", with_kwargs=True)
    m2.register_forward_hook(lambda mod, args, out: log.append(("after bad pre", out)),
                             always_call=True)
    with pytest.raises(RuntimeError) as err:
        m2(3)
    log.append(str(err.value))
    return log


def test_always_call_and_bad_results_follow_torch():
    assert _failing(sf.nn.Module) == _failing(torch.nn.Module)


def test_hook_moves_arguments_of_a_layer():
    """A pre-hook moving the input to another placement: the layer's output lives there."""
    def fn():
        pl, pl2 = sf.placement("cpu", [0]), sf.placement("cpu", [1])
        lin = sf.nn.Linear(3, 2, placement=pl2)
        lin.register_forward_pre_hook(lambda m, args: args[0].to_global(placement=pl2))
        return str(lin(sf.ones(4, 3, placement=pl, sbp=sf.B)).placement)

    assert sf.launch(fn, world_size=2) == ["cpu[1]", "cpu[1]"]


def _hooks_after_conversion() -> tuple:
    import torch.nn as tnn
    pl = sf.placement("cpu", [0, 1])
    net = tnn.Sequential(tnn.Linear(4, 3), tnn.Linear(3, 2)).double()
    seen = []
    net.register_forward_hook(lambda m, a, out: seen.append("torch's"))
    m = sf.parallel.apply(net, pl, {"*": sf.B})
    m.register_forward_hook(lambda mod, a, out: seen.append("after"))
    m(sf.ones(2, 4, placement=pl, sbp=sf.B, dtype=torch.float64))
    refused = []
    for name in ("register_full_backward_hook", "register_full_backward_pre_hook",
                 "register_backward_hook"):
        try:
            getattr(m[1], name)(lambda *a: None)
        except sf.errors.UnsupportedTorchFunction as exc:
            refused.append("backward hooks on a module are not supported" in str(exc))
    return seen, refused


def test_hooks_registered_after_conversion():
    """A forward hook added to a converted model runs beside the one kept from torch (it
    took the kept one's id and replaced it); a backward hook is refused (it was accepted and
    never called: the gradients silently differed from torch's)."""
    seen, refused = sf.launch(_hooks_after_conversion, 2)[0]
    assert seen == ["torch's", "after"]
    assert refused == [True, True, True]
