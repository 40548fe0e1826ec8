"""Helpers shared by the tests: all sbps of a tensor, global tensors with real partial values."""

from __future__ import annotations

import itertools

import torch

import sbpflow as sf
from sbpflow.sbp import Partial, Split, shard_box


def sbps_1d(ndim: int, partial_ops=("sum",)) -> list:
    """Every 1-D sbp of a tensor with ``ndim`` dims."""
    return [sf.S(a) for a in range(ndim)] + [sf.B] + [sf.P(op) for op in partial_ops]


def nd_sbps(ndim: int, mesh_ndim: int, partial_ops=("sum",)) -> list[tuple]:
    return list(itertools.product(sbps_1d(ndim, partial_ops), repeat=mesh_ndim))


def int_tensor(shape, seed: int, dtype=torch.float64, low=-50, high=50) -> torch.Tensor:
    """Integer-valued floats: sums of them are exact, so partial layouts compare exactly."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, tuple(shape), generator=g).to(dtype)


def make_global(full: torch.Tensor, placement, nd_sbp, seed: int = 0) -> "sf.GlobalTensor":
    """A global tensor with logical value ``full`` whose partial dims hold genuinely different
    parts on each rank (not just the value on one rank and zeros), built from local shards.

    For ``P(sum)`` the parts are integers summing exactly to the value; for ``P(max)`` /
    ``P(min)`` the other ranks hold values below / above it.
    """
    nd = sf.parse_nd_sbp(nd_sbp, placement.ndim)
    me = sf.rank()
    shape = tuple(full.shape)
    if me not in placement:
        return sf.from_local(torch.empty(0, dtype=full.dtype), placement, nd, shape=shape)
    coord = placement.coord_of(me)
    box = shard_box(shape, placement.shape, nd, coord)
    value = full[tuple(slice(s, s + n) for s, n in box)]
    pdims = [d for d, s in enumerate(nd) if isinstance(s, Partial)]
    if not pdims:
        return sf.from_local(value.clone(), placement, nd, shape=shape)
    op = nd[pdims[0]].op
    if any(nd[d].op != op for d in pdims):
        raise NotImplementedError(f"make_global: mixed partial kinds {nd} are not supported")
    sizes = [placement.shape[d] for d in pdims]
    members = list(itertools.product(*(range(n) for n in sizes)))
    j = members.index(tuple(coord[d] for d in pdims))
    key = hash((box, seed)) % (1 << 31)

    def noise(k):
        return int_tensor(value.shape, key + 7919 * k, value.dtype, 0, 20)

    if op == "sum":
        local = value - sum((noise(k) for k in range(1, len(members))), torch.zeros_like(value)) \
            if j == 0 else noise(j)
    elif op == "max":
        local = value.clone() if j == 0 else value - noise(j)
    else:
        local = value.clone() if j == 0 else value + noise(j)
    return sf.from_local(local, placement, nd, shape=shape)


def random_local(shape, placement, nd_sbp, seed: int, dtype=torch.float64) -> "sf.GlobalTensor":
    """A global tensor whose shards are arbitrary random values (replicas need not agree):
    boxing is linear on the shards, so adjoint identities hold for any of them."""
    nd = sf.parse_nd_sbp(nd_sbp, placement.ndim)
    me = sf.rank()
    if me not in placement:
        return sf.from_local(torch.empty(0, dtype=dtype), placement, nd, shape=tuple(shape))
    lshape = sf.sbp.local_shape(shape, placement.shape, nd, placement.coord_of(me))
    g = torch.Generator().manual_seed(seed * 1009 + me)
    return sf.from_local(torch.randn(lshape, generator=g, dtype=dtype), placement, nd,
                         shape=tuple(shape))


def splits_only(nd) -> bool:
    return all(isinstance(s, Split) for s in nd)


def signature_layouts(op_name: str, args: tuple, placement, attrs: dict | None = None) -> list[tuple]:
    """The distinct input layouts (one nd-sbp per tensor input) of every N-D signature of a
    registered op for these arguments (``args``: torch tensors in tensor slots, constants else;
    ``attrs``: the op's keyword attributes)."""
    from sbpflow.ops import TensorMeta, get_op
    op = get_op(op_name)
    meta_args = tuple(TensorMeta(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                      for a in args)
    sigs = list(op.signatures(*meta_args, **(attrs or {})))
    n_in = sum(isinstance(a, torch.Tensor) for a in args)
    out = []
    for combo in itertools.product(sigs, repeat=placement.ndim):
        layout = tuple(tuple(sig.ins[i] for sig in combo) for i in range(n_in))
        if layout not in out:
            out.append(layout)
    return out


def check_op(sf_fn, torch_fn, args: tuple, placement, layouts: list[tuple], *, grad: bool = True,
             rtol: float = 1e-9, atol: float = 1e-9, seed: int = 0) -> list:
    """Run inside a launched rank. For each input layout tuple: forward equals ``torch_fn`` on
    the logical values, and (``grad``) every floating input's gradient equals torch's.

    ``args``: torch tensors (the logical inputs) and constants. Returns the failures.
    """
    failures = []
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    ref_in = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in tensors]
    it = iter(ref_in)
    ref_out = torch_fn(*[next(it) if isinstance(a, torch.Tensor) else a for a in args])
    ref_outs = ref_out if isinstance(ref_out, (tuple, list)) else (ref_out,)
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o.shape, generator=g, dtype=o.dtype) if o.is_floating_point() else None
               for o in ref_outs]
    ref_grads = None
    if grad:
        loss = sum((o * w).sum() for o, w in zip(ref_outs, weights) if w is not None)
        ref_grads = torch.autograd.grad(loss, [t for t in ref_in if t.requires_grad],
                                        allow_unused=True)
    for layout in layouts:
        xs = [make_global(t, placement, nd, seed=seed) for t, nd in zip(tensors, layout)]
        if grad:
            for x in xs:
                if x.dtype.is_floating_point:
                    x.requires_grad_()
        it = iter(xs)
        out = sf_fn(*[next(it) if isinstance(a, torch.Tensor) else a for a in args])
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o, r in zip(outs, ref_outs):
            got = o.full_tensor()
            if got.shape != r.shape or not torch.allclose(got.to(r.dtype), r.detach(), rtol=rtol, atol=atol):
                failures.append(("forward", layout, tuple(o.sbp)))
        if grad:
            pairs = [(o, w) for o, w in zip(outs, weights) if w is not None and o.requires_grad]
            for k, (o, w) in enumerate(pairs):
                o.backward(sf.tensor(w, o.placement, tuple(sf.B for _ in o.sbp)),
                           retain_graph=k + 1 < len(pairs))
            gi = iter(ref_grads)
            for x in xs:
                if not x.dtype.is_floating_point:
                    continue
                rg = next(gi)
                if rg is None:
                    continue
                if x.grad is None:
                    failures.append(("no grad", layout))
                    continue
                got = x.grad.full_tensor()
                if not torch.allclose(got, rg, rtol=rtol, atol=atol):
                    failures.append(("grad", layout, float((got - rg).abs().max())))
    return failures


def check_op_signatures(op_name: str, sf_fn, torch_fn, args: tuple, ranks, layouts=None,
                        **kw) -> list:
    """`check_op` in a launched world over ``ranks``, for every signature layout of the op
    (or the given ``layouts``); asserts there is no failure and returns the layouts."""
    pl = sf.placement("cpu", ranks)
    if layouts is None:
        layouts = signature_layouts(op_name, args, pl)

    def body():
        return check_op(sf_fn, torch_fn, args, pl, layouts, **kw)
    failures = sf.launch(body, world_size=pl.size)[0]
    assert not failures, failures[:5]
    return layouts
