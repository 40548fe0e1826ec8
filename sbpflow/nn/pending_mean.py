"""Renamed `sbpflow.nn.eager_count_mean` (its graph form is `sbpflow.nn.graph_count_mean`). This
name is the same module for one release (``sf.nn.pending_mean.guess_counts = False`` still
reaches it), with a DeprecationWarning."""

import sys
import warnings

from . import eager_count_mean

warnings.warn("sbpflow.nn.pending_mean was renamed sbpflow.nn.eager_count_mean",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = eager_count_mean
