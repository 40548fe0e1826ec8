"""``sf.autocast``: mixed precision through ``torch.autocast`` around sbpflow ops.

Kernels run on local torch tensors, so torch's autocast casts them exactly as on one device
(matmul / linear / conv in the low dtype, reductions and softmax in float32). A global tensor's
dtype is its shard's dtype, so outputs report the autocast dtype. Signature choice is cached on
the inputs' metadata (shapes and dtypes), not on the autocast state, which is harmless: the
output metadata sbpflow computes on meta tensors (`sbpflow.ops.registry.out_metas`) is the same
with or without autocast, because CPU autocast does not apply to meta tensors.

A rank OUTSIDE an op's placement runs no kernel and holds an empty shard; for the ops autocast
runs in the low precision (matmul, linear, conv2d) the dispatch gives that shard the autocast
dtype (`sbpflow.tensor.dispatch_records._AUTOCAST_LOWER`), so every rank agrees on the dtype
and later boxing that includes it works. A new op that autocast casts must be added to that
set.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast"]


@contextlib.contextmanager
def autocast(dtype: torch.dtype = torch.bfloat16, enabled: bool = True,
             device_type: str | None = None, cache_enabled: bool | None = None):
    """Run the enclosed sbpflow ops under ``torch.autocast(device_type, dtype)``; without
    ``device_type``, for CPU and (when available) CUDA, since placements may use either."""
    types = [device_type] if device_type else \
        ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    with contextlib.ExitStack() as stack:
        for dt in types:
            stack.enter_context(torch.autocast(dt, dtype=dtype, enabled=enabled,
                                               cache_enabled=cache_enabled))
        yield
