"""Ops: signatures as data on tensor metadata, and the torch kernel of each op.

Each family module registers its ops on import; `sbpflow.tensor` dispatches to them.
"""

from . import elementwise, matmul  # noqa: F401  (registrations)
from . import nn_ops  # noqa: F401  (registrations: transformer ops)
from . import conv  # noqa: F401  (registrations: conv2d and pooling)
from . import norm_ops  # noqa: F401  (registrations: batch / group / rms norm)
from . import reduce, shape  # noqa: F401  (registrations: reductions, shape ops)
from . import select  # noqa: F401  (registrations: values and indices along an axis)
from . import along  # noqa: F401  (registrations: pad, cumsum, gather, scatter, isin, ...)
from . import sampling  # noqa: F401  (registrations: multinomial, the same in any layout)
from . import torch_generic  # noqa: F401  (registrations: any torch function, by its tags)
from .registry import (OPS, Choice, KernelContext, Op, Signature, TensorMeta, choose, detaches,
                       get_op, hashable, out_metas, register, tensor_metas)

__all__ = ["OPS", "Choice", "KernelContext", "Op", "Signature", "TensorMeta", "choose",
           "detaches", "get_op", "hashable", "out_metas", "register", "tensor_metas"]
