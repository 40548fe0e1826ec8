"""``sf.parallel``: parallel layouts of whole models (by parameter name)."""

from .apply import UnmatchedParameterError, apply, match_rules

__all__ = ["apply", "match_rules", "UnmatchedParameterError"]
