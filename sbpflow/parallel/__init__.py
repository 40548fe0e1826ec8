"""``sf.parallel``: parallel layouts of whole models (by parameter name, or any function of it;
ZeRO stages; pipeline stages over several placements; Cyclic Data Parallelism)."""

from . import zero
from .apply import UnmatchedParameterError, apply, match_rules
from .cdp import CyclicDataParallel
from .pipeline import Pipeline, pipeline, pipeline_of
from .pretrained import load_pretrained
from .relayout import relayout

__all__ = ["apply", "match_rules", "relayout", "pipeline", "pipeline_of", "Pipeline",
           "UnmatchedParameterError", "CyclicDataParallel", "zero", "load_pretrained"]
