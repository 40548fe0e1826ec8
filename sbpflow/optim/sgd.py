"""SGD with momentum, dampening, weight decay and Nesterov: torch's update, on local shards."""

from __future__ import annotations

import torch

from .optimizer import _REQUIRED, Optimizer

__all__ = ["SGD"]


class SGD(Optimizer):
    """``torch.optim.SGD``'s update, on each parameter's local shard: by default the
    parameters of a group together with the multi-tensor (``_foreach``) kernels, a few calls a
    step instead of a few a parameter (on a CPU the same kernel a tensor, so the values are
    the single-tensor form's bit for bit); ``foreach=False``: one parameter at a time.

    Linear in (parameter, gradient, buffer), so it also runs on partial-sum layouts."""

    linear_update = True

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool = True) -> None:
        if lr is not _REQUIRED and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      maximize=maximize, foreach=foreach))

    def _update_group(self, params, grads, states, group) -> None:
        if group.get("foreach") is False:
            return super()._update_group(params, grads, states, group)
        batches: dict = {}  # the multi-tensor kernels take one dtype and device a call
        for p, g, st in zip(params, grads, states):
            batches.setdefault((g.dtype, g.device), []).append((p, g, st))
        for items in batches.values():
            _foreach_sgd(items, group)

    def _update(self, p, grad: torch.Tensor, state: dict, group: dict) -> None:
        param = p.local
        d_p = grad if not group["maximize"] else -grad
        wd, momentum = group["weight_decay"], group["momentum"]
        if wd != 0:
            d_p = d_p.add(param, alpha=wd)
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = _new_momentum_buffer(p, d_p, state)
            else:
                buf.local.mul_(momentum).add_(d_p, alpha=1 - group["dampening"])
            d_p = d_p.add(buf.local, alpha=momentum) if group["nesterov"] else buf.local
        param.add_(d_p, alpha=-group["lr"])


def _foreach_sgd(items: list, group: dict) -> None:
    """`SGD._update` on every (parameter, local gradient, state) of ``items`` (one dtype and
    device), each step one multi-tensor call: the same operations in the same order, and no
    gradient written (out-of-place where the single-tensor form is)."""
    params = [p.local for p, _, _ in items]
    d_p = [g for _, g, _ in items]
    if group["maximize"]:
        d_p = torch._foreach_neg(d_p)
    wd, momentum = group["weight_decay"], group["momentum"]
    if wd != 0:
        d_p = torch._foreach_add(d_p, params, alpha=wd)
    if momentum != 0:
        old, old_d, bufs = [], [], []
        for (p, _, st), d in zip(items, d_p):
            buf = st.get("momentum_buffer")
            if buf is None:
                buf = _new_momentum_buffer(p, d, st)
            else:
                old.append(buf.local)
                old_d.append(d)
            bufs.append(buf.local)
        if old:
            torch._foreach_mul_(old, momentum)
            torch._foreach_add_(old, old_d, alpha=1 - group["dampening"])
        d_p = torch._foreach_add(d_p, bufs, alpha=momentum) if group["nesterov"] else bufs
    torch._foreach_add_(params, d_p, alpha=-group["lr"])


def _new_momentum_buffer(p, d_p: torch.Tensor, state: dict):
    """A parameter's first momentum buffer, torch's: a copy of its first step's direction
    ``d_p`` (local), laid out as the parameter; kept in ``state``."""
    from ..tensor import GlobalTensor
    buf = GlobalTensor(torch.clone(d_p).detach(), tuple(p.shape), p.placement, p.sbp)
    state["momentum_buffer"] = buf
    return buf
