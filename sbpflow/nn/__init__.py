"""``sf.nn``: modules and functional ops on global tensors (names mirror ``torch.nn``)."""

from . import functional

__all__ = ["functional"]
