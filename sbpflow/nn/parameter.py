"""``sf.nn.Parameter``: a leaf global tensor that requires grad (modules register it on
assignment)."""

from __future__ import annotations

import torch

from ..placement import Placement
from ..tensor import GlobalTensor, tensor as _sf_tensor
from .recipes import copy_record

__all__ = ["Parameter"]


class Parameter(GlobalTensor):
    """A leaf global tensor that requires grad (by default), registered by `Module` on
    assignment. ``Parameter(global_tensor)`` shares the tensor's shard (copied when the shard
    is a view into a larger buffer, so a split parameter never keeps the whole tensor alive).
    ``Parameter(torch_tensor, placement=, sbp=)`` lays out a logical torch value."""

    __slots__ = ()

    def __init__(self, data, requires_grad: bool = True, *, placement: Placement | None = None,
                 sbp=None) -> None:
        if isinstance(data, torch.Tensor):
            data = _sf_tensor(data.detach(), placement, sbp)
        elif not isinstance(data, GlobalTensor):
            raise TypeError(f"Parameter needs an sf.GlobalTensor or torch.Tensor, got "
                            f"{type(data).__name__}")
        local = data.local.detach()  # (detach drops `_base`: a view's storage shows it)
        if local._base is not None or not local.is_contiguous() or (
                local.device.type != "meta" and
                local.untyped_storage().nbytes() != local.numel() * local.element_size()):
            local = local.clone(memory_format=torch.contiguous_format)
        super().__init__(local.requires_grad_(requires_grad), tuple(data.shape), data.placement,
                         data.sbp)

    def __deepcopy__(self, memo: dict) -> "Parameter":
        """``copy.deepcopy`` (of a module: an EMA copy): a new leaf of the same class, values,
        layout and placement, its own shard (and gradient, as torch's), requiring grad as
        this one. Waits for a ZeRO all-gather in flight first (reading the shard does). A
        meta parameter (`sf.nn.init.meta_init`) keeps its recorded initialisation."""
        local = self.local
        out = type(self).__new__(type(self))
        GlobalTensor.__init__(out, local.detach().clone().requires_grad_(local.requires_grad),
                              self._shape, self._placement, self._sbp)
        if local.grad is not None:
            out._local.grad = local.grad.detach().clone()
        if local.is_meta:
            copy_record(self, out)
        memo[id(self)] = out
        return out

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()
