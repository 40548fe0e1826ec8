"""``sf.autocast``: mixed precision through ``torch.autocast`` around sbpflow ops.

Kernels run on local torch tensors, so torch's autocast casts them exactly as on one device
(matmul / linear / conv in the low dtype, reductions and softmax in float32). A global tensor's
dtype is its shard's dtype, so outputs report the autocast dtype. Signature choice is cached on
the inputs' metadata (shapes and dtypes), not on the autocast state, which is harmless: the
output metadata sbpflow computes on meta tensors (`sbpflow.ops.registry.out_metas`) is the same
with or without autocast, because CPU autocast does not apply to meta tensors.

Known limitation: that metadata's dtype is the non-autocast one, and it is what a rank OUTSIDE
an op's placement uses for its empty shard. Under autocast such a rank then disagrees with the
others on the dtype, and a later boxing to a placement that includes it fails with `CommError`
(tests/nn/test_optim.py, the strict xfail). Ops on placements covering every rank are unaffected.
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
