"""Global tensors (docs/design.md, 'Where each concept lives'): the class and its in-place
bookkeeping (global_tensor), its operators and torch-like methods (methods), what a view
remembers (views), creation ops (creation), the dispatch `apply_op` (dispatch, its records in
dispatch_records), plain torch tensors mixed in (mixing), re-split watching (resplits), and the
hooks through which the graph recorder and the nn layer's torch functions are reached (hooks).

This face re-exports what the other modules of the package import, so none of them names a
module inside. It also wires the class to what it cannot import (they import it): the
dispatch (`_bind_dispatch`) and the op methods (`_set_methods`), before any tensor exists.
"""

from ..errors import UnsupportedTorchFunction
from .global_tensor import GlobalTensor, _bind_dispatch, retains_grads
from .dispatch import apply_op, cat
from .mixing import lift, lift_arguments, lifting_plain_tensors
from .methods import _set_methods, _to_dtype, numpy_names
from .creation import (_next_seed, arange, from_local, full, manual_seed, ones, rand, randn,
                       tensor, zeros)
from .hooks import (current_recorder, error_rule, errors_as, fresh, guard, module_called,
                    recording, set_recorder, set_torch_dispatch, source)
from .resplits import watch_resplit
from .views import copy_view, is_view

_bind_dispatch(apply_op)
_set_methods(GlobalTensor)

__all__ = ["GlobalTensor", "retains_grads", "tensor", "from_local", "randn", "rand", "zeros",
           "ones", "full", "arange", "manual_seed", "apply_op", "cat", "recording", "set_recorder",
           "fresh", "guard", "source", "module_called", "errors_as", "error_rule",
           "UnsupportedTorchFunction",
           "set_torch_dispatch", "lift", "watch_resplit", "is_view", "copy_view", "numpy_names"]
