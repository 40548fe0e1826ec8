"""Adam and AdamW: torch's update formulas (bias correction, amsgrad, maximize), on local
shards; ``exp_avg`` / ``exp_avg_sq`` are global tensors in the parameter's layout.

The parameters of a group are updated together with torch's multi-tensor (``_foreach``)
kernels, a few calls for the whole group instead of a few per parameter (``foreach=False``:
one parameter at a time, torch's single-tensor form). Both compute the same formula."""

from __future__ import annotations

import torch

from .optimizer import Optimizer, state_like

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """``torch.optim.Adam``'s update, multi-tensor (``foreach=False``: one parameter at a
    time). ``weight_decay`` is L2 added to the gradient (``decoupled_weight_decay=True``:
    AdamW's decay of the parameter)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = False, foreach: bool = True) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, amsgrad=amsgrad,
                                      maximize=maximize,
                                      decoupled_weight_decay=decoupled_weight_decay,
                                      foreach=foreach))

    def _update_group(self, params, grads, states, group) -> None:
        if group.get("foreach") is False:  # None (a torch state dict's default): multi-tensor
            return super()._update_group(params, grads, states, group)
        for st, p in zip(states, params):
            self._init_state(p, st, group)
            st["step"] += 1
        # one multi-tensor pass per (step, dtype, device): bias corrections are per step
        batches: dict = {}
        for p, g, st in zip(params, grads, states):
            batches.setdefault((st["step"], g.dtype, g.device), []).append((p, g, st))
        for (step, _, _), items in batches.items():
            self._foreach_step([p.local for p, _, _ in items], [g for _, g, _ in items],
                               [st for _, _, st in items], float(step), group)

    @staticmethod
    def _foreach_step(params, grads, states, step, group) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        if group["maximize"]:
            grads = torch._foreach_neg(grads)
        exp_avgs = [st["exp_avg"].local for st in states]
        exp_avg_sqs = [st["exp_avg_sq"].local for st in states]
        if wd != 0:
            if group["decoupled_weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * wd)
            else:
                grads = torch._foreach_add(grads, params, alpha=wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        if group["amsgrad"]:
            mx = [st["max_exp_avg_sq"].local for st in states]
            torch._foreach_maximum_(mx, exp_avg_sqs)
            denom = torch._foreach_sqrt(mx)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)

    @staticmethod
    def _init_state(p, state: dict, group: dict) -> None:
        if not state:
            state["step"] = 0
            state["exp_avg"] = state_like(p)
            state["exp_avg_sq"] = state_like(p)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = state_like(p)

    def _update(self, p, grad: torch.Tensor, state: dict, group: dict) -> None:
        param = p.local
        self._init_state(p, state, group)
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        grad = grad if not group["maximize"] else -grad
        exp_avg, exp_avg_sq = state["exp_avg"].local, state["exp_avg_sq"].local
        state["step"] += 1
        step = float(state["step"])
        if wd != 0:
            if group["decoupled_weight_decay"]:
                param.mul_(1 - lr * wd)
            else:
                grad = grad.add(param, alpha=wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        if group["amsgrad"]:
            mx = state["max_exp_avg_sq"].local
            torch.maximum(mx, exp_avg_sq, out=mx)
            denom = (mx.sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


class AdamW(Adam):
    """``torch.optim.AdamW``: Adam with decoupled weight decay (default 1e-2)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool = True) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, foreach=foreach)
