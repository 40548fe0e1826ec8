"""``sf.nn.Parameter``: a leaf global tensor that requires grad (modules register it on
assignment)."""

from __future__ import annotations

import torch

from ..placement import Placement
from ..tensor import GlobalTensor, tensor as _sf_tensor

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

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()
