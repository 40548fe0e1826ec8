"""``sf.optim``: optimizers on global parameters (torch's API and update formulas).

Gradients are boxed to each parameter's layout before the update (all-reduce for replicated
parameters, reduce-scatter for split ones: data parallelism and ZeRO fall out of the layouts);
state lives in the parameter's layout. ``sf.optim.lr_scheduler`` is torch's own module: its
schedulers work on these optimizers unchanged.
"""

from torch.optim import lr_scheduler  # noqa: F401  (torch's schedulers work on sf optimizers)

from .adam import Adam, AdamW
from .clip import clip_grad_norm_, grad_norm
from .optimizer import Optimizer, OptimizerStateError, boxed_grad
from .sgd import SGD

__all__ = ["Optimizer", "OptimizerStateError", "SGD", "Adam", "AdamW", "clip_grad_norm_",
           "grad_norm", "boxed_grad", "lr_scheduler"]
