"""``sf.parallel.hf_tp_plan``: a transformers model's own tensor-parallel plan as sbpflow rules.

transformers models declare their plan (``model.tp_plan`` / ``_tp_plan``, or the config's
``base_model_tp_plan``): module patterns (``*`` a layer number) to styles such as "colwise",
"rowwise", "colwise_gather_output", "embedding_rowwise". Each becomes rules of its module's
parameters with a module-aware `Style` (parallel/styles.py) on one mesh dim, and a last ``"*"``:
replicated. HF's styles also fix activation layouts (a gathered output, a split input); here
activations take the layouts the ops choose by cost (the loss reads vocabulary-split logits
without gathering them). Families transformers gives no plan have one in `BUILTIN_PLANS`
(GPT-2, OPT, BERT: Megatron's roles), relative to the base model as ``base_model_tp_plan`` is,
and `BUILTIN_HEADS` for their heads (default: ``lm_head`` column-parallel).
"""

from __future__ import annotations

import re
from typing import Mapping

from ..errors import SbpError
from .styles import Style, colwise, replicate, rowwise

__all__ = ["hf_tp_plan", "HF_STYLES", "BUILTIN_PLANS", "BUILTIN_HEADS"]

# transformers' style names (transformers/distributed/tensor_parallel.py, 5.x) -> sbpflow style
HF_STYLES: dict[str, Style] = {
    **dict.fromkeys(("colwise", "colwise_rep", "colwise_gather_output", "packed_colwise",
                     "local_colwise", "embedding_colwise"), colwise),
    **dict.fromkeys(("rowwise", "rowwise_rep", "rowwise_split_input", "packed_rowwise",
                     "local_rowwise", "embedding_rowwise"), rowwise),
    **dict.fromkeys(("replicate", "replicated_with_grad_allreduce", "sequence_parallel",
                     "all_reduce", "local_params", "local", "gather", "isolated"), replicate),
}

# plans for families whose transformers classes declare none (keys relative to the base model)
BUILTIN_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {"wte": "embedding_rowwise", "h.*.attn.c_attn": "colwise",
             "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
             "h.*.mlp.c_proj": "rowwise"},
    "opt": {"decoder.embed_tokens": "embedding_rowwise",
            "decoder.layers.*.self_attn.q_proj": "colwise",
            "decoder.layers.*.self_attn.k_proj": "colwise",
            "decoder.layers.*.self_attn.v_proj": "colwise",
            "decoder.layers.*.self_attn.out_proj": "rowwise",
            "decoder.layers.*.fc1": "colwise", "decoder.layers.*.fc2": "rowwise"},
    "bert": {"embeddings.word_embeddings": "embedding_rowwise",
             "encoder.layer.*.attention.self.query": "colwise",
             "encoder.layer.*.attention.self.key": "colwise",
             "encoder.layer.*.attention.self.value": "colwise",
             "encoder.layer.*.attention.output.dense": "rowwise",
             "encoder.layer.*.intermediate.dense": "colwise",
             "encoder.layer.*.output.dense": "rowwise"},
}
# the heads' entries (names from the model's root; keys that name nothing are dropped)
BUILTIN_HEADS: dict[str, dict[str, str]] = {
    "bert": {"cls.predictions.decoder": "colwise", "cls.predictions.bias": "colwise"},
}


def hf_tp_plan(model, mesh_dim: int | None = None, dp_dim: int | None = None,
               plan: Mapping[str, str] | None = None) -> dict:
    """Rules for `sf.parallel.apply` from ``model``'s tensor-parallel plan: ``plan`` if given
    (HF style: full module names or patterns with ``*`` for layer numbers -> style names),
    else the model's own (``tp_plan`` / ``_tp_plan`` / ``config.base_model_tp_plan``), else
    `BUILTIN_PLANS` for its ``config.model_type``. Each parameter of a planned module gets the
    module-aware style (colwise / rowwise / replicate) splitting on mesh dim ``mesh_dim``
    (default: the last, or the one that is not ``dp_dim``), B on the others; every other
    parameter is replicated (last rule ``"*"``). Pure: reads names only, communicates nothing.
    Raises `sf.SbpError` for a model without a plan or a style sbpflow does not map."""
    raw = dict(plan) if plan is not None else _declared_plan(model)
    if not raw:
        kind = getattr(getattr(model, "config", None), "model_type", None)
        raise SbpError(
            f"sf.parallel.hf_tp_plan: {type(model).__name__} (model_type {kind!r}) declares no "
            f"tensor-parallel plan and sbpflow has none built in (it has {sorted(BUILTIN_PLANS)}); "
            f"pass plan={{'<module pattern>': 'colwise' | 'rowwise' | ...}}")
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]  # tied: each name
    rules: dict = {}
    for key, style_name in raw.items():
        style = HF_STYLES.get(style_name)
        if style is None:
            raise SbpError(
                f"sf.parallel.hf_tp_plan: style {style_name!r} of {key!r} has no sbpflow "
                f"equivalent here (known: {sorted(HF_STYLES)}); override it with plan= or "
                f"write the rule for its parameters yourself")
        for pattern in _param_patterns(key, params):
            rules.setdefault(pattern, style(mesh_dim, dp_dim))
    rules["*"] = replicate(mesh_dim, dp_dim)
    return rules


def _declared_plan(model) -> dict:
    """The model's full plan (names from ``model``'s root), or the built-in one."""
    for attr in ("tp_plan", "_tp_plan"):
        got = getattr(model, attr, None)
        if isinstance(got, Mapping) and got:
            return dict(got)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or \
        BUILTIN_PLANS.get(getattr(config, "model_type", None), {})
    prefix = getattr(model, "base_model_prefix", "")
    root = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    out = {f"{root}{k}": v for k, v in base.items()}
    if out and root:
        head = BUILTIN_HEADS.get(getattr(config, "model_type", None),
                                 {"lm_head": "colwise_gather_output"})
        out.update({k: v for k, v in head.items() if k not in out})
    return out


def _param_patterns(key: str, params: list[str]) -> list[str]:
    """fnmatch patterns of the parameters ``key`` names: itself if it names parameters, else
    ``key.<attr>`` for each direct parameter of the modules it names (``*``: a layer number,
    as transformers reads it)."""
    exact = re.compile(re.escape(key).replace(r"\*", r"\d+"))
    if any(exact.fullmatch(p) for p in params):
        return [key]
    attrs = []
    for p in params:
        mod, _, attr = p.rpartition(".")
        if exact.fullmatch(mod) and attr not in attrs:
            attrs.append(attr)
    return [f"{key}.{a}" for a in attrs]
