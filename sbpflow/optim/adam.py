"""Adam and AdamW: torch's update formulas (bias correction, amsgrad, maximize), on local
shards; ``exp_avg`` / ``exp_avg_sq`` are global tensors in the parameter's layout.

The parameters of a group are updated together: by default with torch's fused kernel
(``torch._fused_adam_`` / ``_fused_adamw_``: one pass over each parameter's memory; on a CPU
about 3x faster than the multi-tensor form, for the example GPT's 0.5M to 3M parameters); else
with the multi-tensor (``_foreach``) kernels (``fused=False``); or one parameter at a time,
torch's single-tensor form (``foreach=False``). The fused kernel takes contiguous tensors only:
a shard that is a strided view goes the multi-tensor way. All compute torch's formula (the
fused kernel rounds in its own order)."""

from __future__ import annotations

import itertools

import torch

from .optimizer import Optimizer, state_like

__all__ = ["Adam", "AdamW"]


# what torch's fused Adam kernels take
_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Adam(Optimizer):
    """``torch.optim.Adam``'s update: fused, multi-tensor (``fused=False``) or one parameter at
    a time (``foreach=False``, as torch). ``fused=None`` (the default) fuses the parameters
    whose device and dtype torch's fused kernel takes, the others multi-tensor.
    ``weight_decay`` is L2 added to the gradient (``decoupled_weight_decay=True``: AdamW's
    decay of the parameter)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = False, foreach: bool = True,
                 fused: bool | None = None) -> None:
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
                                      foreach=foreach, fused=fused))

    def _update_group(self, params, grads, states, group) -> None:
        fused, foreach = group.get("fused"), group.get("foreach")
        if not fused and foreach is False:  # as torch: foreach=False alone is one at a time
            return super()._update_group(params, grads, states, group)
        for st, p in zip(states, params):
            if not st:
                self._init_state(p, st, group)
            st["step"] += 1
        step = states[0]["step"]
        g0 = grads[0]
        if all(st["step"] == step for st in states) and \
                all(g.dtype == g0.dtype and g.device == g0.device for g in grads):
            # the usual case, one batch: no per-parameter grouping
            self._update_batch(params, grads, states, step, g0.dtype, g0.device, group)
            return
        # one pass per (step, dtype, device): bias corrections are per step
        batches: dict = {}
        for p, g, st in zip(params, grads, states):
            batches.setdefault((st["step"], g.dtype, g.device), []).append((p, g, st))
        for (step, dtype, device), items in batches.items():
            self._update_batch([p for p, _, _ in items], [g for _, g, _ in items],
                               [st for _, _, st in items], step, dtype, device, group)

    def _idle_group(self, params, states, group) -> None:
        """Another rank's parameters (empty shards): the step counted and the state made, as
        the update would, and nothing else."""
        for p, st in zip(params, states):
            if not st:
                self._init_state(p, st, group)
            st["step"] += 1

    def _update_batch(self, params, grads, states, step, dtype, device, group) -> None:
        """Update parameters of one step, dtype and device: fused where the kernel takes them."""
        fused = group.get("fused")
        ps = [p.local for p in params]
        # states are plain global tensors (never settling twins): their slot read directly
        tensors = (ps, grads, [st["exp_avg"].shard for st in states],
                   [st["exp_avg_sq"].shard for st in states],
                   [st["max_exp_avg_sq"].shard for st in states] if group["amsgrad"] else [])
        takes = device.type in _FUSED_DEVICES and dtype in _FUSED_DTYPES
        if takes and fused is not False and \
                all(map(torch.Tensor.is_contiguous, itertools.chain(*tensors))):
            self._fused_step(*tensors, step, group)   # every one: no per-parameter mask
            return
        # the kernel walks flat memory: a shard that is a strided view goes multi-tensor
        fuse = [fused is not False and takes and _contiguous_state(p, g, st)
                for p, g, st in zip(ps, grads, states)]
        if fused and not all(fuse):
            raise ValueError(f"{type(self).__name__}(fused=True): torch's fused kernel takes "
                             f"contiguous {_FUSED_DTYPES} tensors on {_FUSED_DEVICES}, not "
                             f"these {dtype} ones on {device}; use fused=None")
        if any(fuse):
            self._fused_step(*_where(fuse, True, *tensors), step, group)
        if not all(fuse):
            self._foreach_step(*_where(fuse, False, ps, grads, states), float(step), group)

    @staticmethod
    def _fused_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, step, group) -> None:
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        # the kernel reads the (already incremented) step of each parameter
        steps = [torch.full((), float(step), device=params[0].device)] * len(params)
        kernel(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=group["lr"],
               beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
               amsgrad=group["amsgrad"], maximize=group["maximize"])

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


def _contiguous_state(param: torch.Tensor, grad: torch.Tensor, state: dict) -> bool:
    if not (param.is_contiguous() and grad.is_contiguous() and
            state["exp_avg"].local.is_contiguous() and state["exp_avg_sq"].local.is_contiguous()):
        return False
    mx = state.get("max_exp_avg_sq")
    return mx is None or mx.local.is_contiguous()


def _where(mask: list, want: bool, *lists: list) -> list:
    """Each of ``lists`` kept where ``mask`` is ``want`` (an empty list stays empty)."""
    return [[x for x, m in zip(xs, mask) if m == want] for xs in lists]


class AdamW(Adam):
    """``torch.optim.AdamW``: Adam with decoupled weight decay (default 1e-2)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool = True, fused: bool | None = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True, foreach=foreach, fused=fused)
