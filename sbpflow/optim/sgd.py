"""SGD with momentum, dampening, weight decay and Nesterov: torch's update, on local shards."""

from __future__ import annotations

import torch

from .optimizer import _REQUIRED, Optimizer

__all__ = ["SGD"]


class SGD(Optimizer):
    """``torch.optim.SGD``'s update (single-tensor form), on each parameter's local shard.

    Linear in (parameter, gradient, buffer), so it also runs on partial-sum layouts."""

    linear_update = True

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False) -> None:
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
                                      maximize=maximize))

    def _update(self, p, grad: torch.Tensor, state: dict, group: dict) -> None:
        param = p.local
        d_p = grad if not group["maximize"] else -grad
        wd, momentum = group["weight_decay"], group["momentum"]
        if wd != 0:
            d_p = d_p.add(param, alpha=wd)
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                from ..tensor import GlobalTensor
                buf = GlobalTensor(torch.clone(d_p).detach(), tuple(p.shape), p.placement, p.sbp)
                state["momentum_buffer"] = buf
            else:
                buf.local.mul_(momentum).add_(d_p, alpha=1 - group["dampening"])
            d_p = d_p.add(buf.local, alpha=momentum) if group["nesterov"] else buf.local
        param.add_(d_p, alpha=-group["lr"])
