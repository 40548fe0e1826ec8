"""``sf.parallel``: parallel layouts of whole models (by parameter name, or any function of it)."""

from .apply import UnmatchedParameterError, apply, match_rules
from .relayout import relayout

__all__ = ["apply", "match_rules", "relayout", "UnmatchedParameterError"]
