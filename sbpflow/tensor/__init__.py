"""Global tensors (docs/design.md, 'Where each concept lives'): the class and its views and
in-place bookkeeping, creation ops, the dispatch `apply_op`, plain torch tensors mixed in, and
the hooks through which the graph recorder and the nn layer's torch functions are reached.

This face re-exports what the other modules of the package import, so none of them names a
module inside.
"""

from .creation import (_next_seed, arange, from_local, full, manual_seed, ones, rand, randn,
                       tensor, zeros)
from .global_tensor import (GlobalTensor, UnsupportedTorchFunction, _to_dtype, apply_op, cat,
                            copy_view, is_view, lift, lift_arguments, lifting_plain_tensors,
                            numpy_names, retains_grads)
from .hooks import (current_recorder, error_rule, errors_as, fresh, guard, module_called,
                    recording, set_recorder, set_torch_dispatch, source, watch_resplit)

__all__ = ["GlobalTensor", "retains_grads", "tensor", "from_local", "randn", "rand", "zeros",
           "ones", "full", "arange", "manual_seed", "apply_op", "cat", "recording", "set_recorder",
           "fresh", "guard", "source", "module_called", "errors_as", "error_rule",
           "UnsupportedTorchFunction",
           "set_torch_dispatch", "lift", "watch_resplit", "is_view", "copy_view", "numpy_names"]
