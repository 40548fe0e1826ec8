"""Activation checkpointing: ``sf.nn.checkpoint(module, *inputs)``.

The module runs once without keeping its activations; backward recomputes it. This is
``torch.utils.checkpoint`` (non-reentrant) over the *local* shards, with GlobalTensors re-wrapped
inside, so the recomputation re-runs the same ops — and therefore the same collectives in the
same order — on every rank, from inside that rank's backward (which, on CPU, runs on the rank's
own thread). ``early_stop`` is off: every rank recomputes the whole function, so ranks whose
autograd graphs save different tensors (a holder and a non-holder of a partial value) still
issue the same collectives. sbpflow's own random stream (`sf.manual_seed`, used by dropout) is
rewound for the recomputation, so dropout masks repeat; torch's RNG is preserved by torch.

Limitation: a rank that saves no tensor at all inside the region (e.g. one outside every
placement used there) never triggers the recomputation; regions whose collectives involve such
ranks are not supported.
"""

from __future__ import annotations

import torch.utils.checkpoint as _tc

from .. import comm as _comm
from ..errors import GraphError
from ..tensor import GlobalTensor, recording

__all__ = ["checkpoint"]


def checkpoint(function, *args, preserve_rng_state: bool = True, **kwargs):
    """``function(*args, **kwargs)`` with its activations recomputed in backward. ``args`` may
    mix global tensors and constants; the result is a global tensor or a tuple / list of them
    (other values are passed through unchanged). Not in a graph's ``build`` (`GraphError`): its
    replay would keep the activations, which is not what checkpointing is asked for."""
    if recording():
        raise GraphError("sf.nn.checkpoint (activation checkpointing) in a graph's build is not "
                         "supported yet: a graph would keep the activations it is asked to "
                         "drop. Call the module directly in build, or train in eager mode")
    slots = [i for i, a in enumerate(args) if isinstance(a, GlobalTensor)]
    metas = {i: (tuple(args[i].shape), args[i].placement, args[i].sbp) for i in slots}
    state = _comm.current().per_rank
    rewind = (state.seed, state.seed_counter)
    out_meta: dict = {}
    calls = [0]

    def run(*locals_):
        full = list(args)
        for i, local in zip(slots, locals_):
            shape, pl, sbp = metas[i]
            full[i] = GlobalTensor(local, shape, pl, sbp)
        recompute = calls[0] > 0
        calls[0] += 1
        if recompute:
            saved = (state.seed, state.seed_counter)
            state.seed, state.seed_counter = rewind
        try:
            out = function(*full, **kwargs)
        finally:
            if recompute:
                state.seed, state.seed_counter = saved
        if isinstance(out, GlobalTensor):
            out_meta["kind"] = "one"
            out_meta["metas"] = [(tuple(out.shape), out.placement, out.sbp)]
            return out.local
        if isinstance(out, (tuple, list)):
            out_meta["kind"] = type(out)
            out_meta["metas"] = [(tuple(o.shape), o.placement, o.sbp)
                                 if isinstance(o, GlobalTensor) else None for o in out]
            return tuple(o.local if isinstance(o, GlobalTensor) else o for o in out)
        out_meta["kind"] = "other"
        return out

    res = _tc.checkpoint(run, *[args[i].local for i in slots], use_reentrant=False,
                         preserve_rng_state=preserve_rng_state, early_stop=False)
    kind = out_meta["kind"]
    if kind == "one":
        shape, pl, sbp = out_meta["metas"][0]
        return GlobalTensor(res, shape, pl, sbp)
    if kind == "other":
        return res
    outs = [GlobalTensor(r, *m) if m is not None else r for r, m in zip(res, out_meta["metas"])]
    return kind(outs)
