"""``sf.load_pretrained``: a Hugging Face checkpoint (safetensors, single file or sharded) read
into a model laid out by rules: the model converted and laid out first (`sf.parallel.apply`),
then each rank reads only its shards' bytes (`sbpflow.nn.safetensors_io.load_safetensors`).
See docs/huggingface.md, 'Checkpoints for the ecosystem'.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import SbpError
from ..nn.modules import Module
from ..nn.safetensors_io import load_safetensors
from ..nn.torch_modules import from_torch, is_torch_module
from ..placement import Placement
from ..sbp import B
from .apply import apply

__all__ = ["load_pretrained"]


def load_pretrained(model, path: str, placement: Placement | None = None,
                    rules: Mapping | None = None, *, zero: int = 0, strict: bool = True,
                    info: dict | None = None) -> Module:
    """Read the Hugging Face checkpoint at ``path`` into ``model``; returns the model to call.

    With ``placement``: ``model`` (a torch model, e.g. ``AutoModelForCausalLM.from_config``,
    or an sbpflow one) is first laid out by ``rules`` (default: every parameter replicated)
    and ``zero`` as `sf.parallel.apply` does, then filled. A torch model built under
    ``torch.device("meta")`` is never whole anywhere: each rank allocates its shards only; its
    non-persistent buffers (rotary frequencies) are computed by the model's
    ``_init_weights``, as transformers does. Without: ``model`` must be an
    sbpflow model, filled in its current layouts. Each rank reads only the regions its
    shards hold; checks and errors (`CheckpointShapeError`, `CheckpointKeyError` with
    ``strict``) as `load_safetensors`. A collective: every rank calls it alike."""
    if placement is not None:
        if is_torch_module(model):   # may be built on the meta device: shards materialised
            model = from_torch(model, placement, meta=True)
        model = apply(model, placement, rules if rules is not None else
                      {"*": (B,) * placement.ndim}, zero=zero)
    elif is_torch_module(model) or not isinstance(model, Module):
        raise SbpError(f"sf.load_pretrained: a {type(model).__name__} has no layout yet; give "
                       f"placement= (and rules=) to lay it out, or pass the model "
                       f"sf.parallel.apply returned")
    elif rules is not None or zero:
        raise SbpError("sf.load_pretrained: rules= and zero= lay a model out on placement=; "
                       "give placement= too (or apply the layout first)")
    return load_safetensors(model, path, strict=strict, info=info)
