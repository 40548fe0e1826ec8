"""``sf.parallel``: parallel layouts of whole models (by parameter name, or any function of it;
module-aware styles colwise / rowwise; a transformers model's own tensor-parallel plan; ZeRO
stages; pipeline stages over several placements; Cyclic Data Parallelism)."""

from . import zero
from .apply import UnmatchedParameterError, apply, match_rules
from .cdp import CyclicDataParallel
from .hf_plan import BUILTIN_HEADS, BUILTIN_PLANS, HF_STYLES, hf_tp_plan
from .pipeline import Pipeline, pipeline, pipeline_of
from .pretrained import load_pretrained
from .relayout import relayout
from .styles import Style, colwise, replicate, rowwise

__all__ = ["apply", "match_rules", "relayout", "pipeline", "pipeline_of", "Pipeline",
           "UnmatchedParameterError", "CyclicDataParallel", "zero", "load_pretrained",
           "Style", "colwise", "rowwise", "replicate", "hf_tp_plan", "HF_STYLES", "BUILTIN_PLANS",
           "BUILTIN_HEADS"]
