"""``sf.nn``: modules and functional ops on global tensors (names mirror ``torch.nn``)."""

from . import functional, functional_conv, init
from .amp import autocast
from .init import materialize_, meta_init
from .layers import (GELU, CrossEntropyLoss, AdaptiveAvgPool2d, AvgPool2d, Conv2d, Dropout, Embedding,
                     Flatten, Identity, LayerNorm, Linear, MaxPool2d, ModuleDict, ModuleList, ReLU,
                     Sequential, SiLU, Sigmoid, Softmax, Tanh)
from .modules import Module, Parameter, StateDictError
from .norm import BatchNorm1d, BatchNorm2d, GroupNorm, RMSNorm
from .recompute import checkpoint
from .serialization import CheckpointError, load, save
from . import torch_functions, torch_handlers  # noqa: F401  (torch functions on global tensors)
from .torch_autograd import install as _install_autograd
from .torch_modules import from_torch
from .torch_fallback import ReplicatedFallbackWarning
from .torch_layouts import CostlyLayoutWarning

_install_autograd()   # custom torch.autograd.Functions called with global tensors

__all__ = ["functional", "functional_conv", "init", "Module", "Parameter", "StateDictError",
           "Linear", "Embedding", "LayerNorm", "Dropout", "GELU", "ReLU", "Tanh", "Sigmoid",
           "SiLU", "Identity", "Softmax", "Conv2d", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d",
           "Flatten", "Sequential", "ModuleList", "ModuleDict", "checkpoint", "autocast",
           "save", "load", "CheckpointError", "meta_init", "materialize_", "CrossEntropyLoss",
           "from_torch"]
__all__ += ["BatchNorm1d", "BatchNorm2d", "GroupNorm", "RMSNorm", "CostlyLayoutWarning",
            "ReplicatedFallbackWarning"]


def __getattr__(name: str):
    """``sf.nn.pending_mean`` was renamed ``sf.nn.eager_count_mean`` (the old name for one
    release, with a DeprecationWarning)."""
    if name == "pending_mean":
        import importlib
        return importlib.import_module(f"{__name__}.pending_mean")
    raise AttributeError(f"module 'sbpflow.nn' has no attribute {name!r}")
