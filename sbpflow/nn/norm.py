"""Normalisation layers with torch.nn's names, arguments, parameters and buffers:
``BatchNorm1d``, ``BatchNorm2d``, ``GroupNorm``, ``RMSNorm``.

Batch norm normalises over the LOGICAL batch whatever the layout (SyncBatchNorm when the batch
is split). Its running statistics are buffers updated as torch's; they follow the input onto
its placement, replicated (split like the channels when those are split). Each layer takes
``placement=`` and ``sbp=`` (its weight's layout) as the other `sf.nn` layers. See docs/internals.md, 'Normalisation layers'.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError
from ..placement import Placement
from ..sbp import B, S, Split
from ..tensor import GlobalTensor, ones, set_recorder, zeros
from . import functional_norm as FN
from . import init
from .layers import _param
from .modules import Module

__all__ = ["BatchNorm1d", "BatchNorm2d", "GroupNorm", "RMSNorm"]


def _moved(t: GlobalTensor, placement: Placement, nd: tuple) -> GlobalTensor:
    """Buffer ``t`` laid out as ``nd`` on ``placement``. Done outside any graph being traced:
    the moved buffer is then state the graph reads (and the update writes) at every replay,
    not a value it would recompute from the old one."""
    previous = set_recorder(None)
    try:
        with torch.no_grad():
            return t.to_global(placement, nd)
    finally:
        set_recorder(previous)


def _channel_layout(x: GlobalTensor) -> tuple:
    """The layout of per-channel statistics beside ``x``: split where ``x``'s channels are
    split, replicated elsewhere."""
    return tuple(S(0) if isinstance(s, Split) and s.axis == 1 else B for s in x.sbp)


class _BatchNorm(Module):
    """Batch norm over the logical batch (`sf.nn.functional.batch_norm`). ``weight`` (ones) and
    ``bias`` (zeros) if ``affine``; buffers ``running_mean`` (zeros), ``running_var`` (ones) and
    ``num_batches_tracked`` if ``track_running_stats``, replicated. ``momentum=None``: the
    running statistics are a cumulative average, as torch."""

    _dims: tuple = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 placement: Placement | None = None, sbp=None, *,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        c = self.num_features = int(num_features)
        self.eps, self.momentum = float(eps), momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        if affine:
            self.weight = _param((c,), placement, sbp, dtype)
            self.bias = _param((c,), self.weight.placement, self.weight.sbp, dtype)
            placement = self.weight.placement
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", zeros(c, placement=placement, dtype=dtype))
            self.register_buffer("running_var", ones(c, placement=placement, dtype=dtype))
            self.register_buffer("num_batches_tracked",
                                 zeros((), placement=placement, dtype=torch.int64))
        else:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                self.register_buffer(name, None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.local.zero_()
                self.running_var.local.fill_(1)
                self.num_batches_tracked.local.zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def _check_input_dim(self, x: GlobalTensor) -> None:
        if x.ndim not in self._dims:
            want = " or ".join(f"{d}D" for d in self._dims)
            raise ShapeError(f"{type(self).__name__}: expected {want} input (got {x.ndim}D "
                             f"input of shape {tuple(x.shape)}, sbp {x.sbp}, on {x.placement})")

    def _follow(self, x: GlobalTensor) -> None:
        """Lay the buffers out beside the input: on its placement (they stay where the layer
        was built when `sf.parallel.apply` moves its parameters), replicated, or split like
        its channels (so a channel split updates them without communication). Moved when the
        input's placement or channel layout changes, not on every call."""
        stats_nd = _channel_layout(x)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            t = self._buffers.get(name)
            nd = stats_nd if t is not None and t.ndim else (B,) * x.placement.ndim
            if t is not None and (t.placement != x.placement or t.sbp != nd):
                self._buffers[name] = _moved(t, x.placement, nd)

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        self._check_input_dim(x)
        self._follow(x)
        track = self.track_running_stats and self.running_mean is not None
        use_batch_stats = self.training or self.running_mean is None
        keep_running = not self.training or self.track_running_stats
        return FN.batch_norm(
            x, self.running_mean if keep_running else None,
            self.running_var if keep_running else None, self.weight, self.bias,
            use_batch_stats, self.momentum, self.eps,
            num_batches_tracked=self.num_batches_tracked if self.training and track else None)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Batch norm of (N, C) or (N, C, L) inputs."""

    _dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch norm of (N, C, H, W) inputs."""

    _dims = (4,)


class GroupNorm(Module):
    """Group norm (`sf.nn.functional.group_norm`); ``weight`` ones and ``bias`` zeros of shape
    (num_channels,) if ``affine``."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5,
                 affine: bool = True, placement: Placement | None = None, sbp=None, *,
                 bias: bool = True, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if num_groups <= 0 or num_channels % num_groups:
            raise ShapeError(f"GroupNorm: num_channels {num_channels} must be divisible by "
                             f"num_groups {num_groups}")
        self.num_groups, self.num_channels = int(num_groups), int(num_channels)
        self.eps, self.affine = float(eps), affine
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if affine:
            self.weight = _param((num_channels,), placement, sbp, dtype)
            init.ones_(self.weight)
            if bias:
                self.bias = _param((num_channels,), self.weight.placement, self.weight.sbp,
                                   dtype)
                init.zeros_(self.bias)

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return FN.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


class RMSNorm(Module):
    """RMS norm over the trailing ``normalized_shape`` (`sf.nn.functional.rms_norm`);
    ``weight`` ones if ``elementwise_affine``; ``eps=None``: the dtype's epsilon, as torch."""

    def __init__(self, normalized_shape, eps: float | None = None,
                 elementwise_affine: bool = True, placement: Placement | None = None, sbp=None,
                 *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        ns = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape = tuple(int(n) for n in ns)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        if elementwise_affine:
            self.weight = _param(self.normalized_shape, placement, sbp, dtype)
            init.ones_(self.weight)
        else:
            self.register_parameter("weight", None)

    def forward(self, x: GlobalTensor) -> GlobalTensor:
        return FN.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")
