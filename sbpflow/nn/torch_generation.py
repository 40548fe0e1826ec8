"""Hugging Face ``generate()`` on converted models: the steps of transformers' generation that
read tensors by their Python type or assume one device.

* `expanding`: transformers repeats a tensor argument per beam (``_expand_inputs_for_generation``)
  only when it ``isinstance(v, torch.Tensor)``; global tensors are repeated too.
* `generating`: a model whose stages sit on several placements (``sf.parallel.pipeline``) gives
  its logits on the last stage while the ids grow on the first: during ``generate`` each
  forward's outputs (not its cache, whose layers stay on their stages) move to the ids'
  placement, the last position's logits a step, and beam search reorders each cache layer on
  its own stage.
"""

from __future__ import annotations

import inspect

from ..sbp import B
from ..tensor import GlobalTensor

__all__ = ["expanding", "generating"]
_CACHES = ("past_key_values", "cache")  # outputs that stay where they were made


def _repeated(value, times: int):
    if isinstance(value, GlobalTensor):
        return value.repeat_interleave(times, dim=0)
    return value


def expanding(cls: type):
    """``cls._expand_inputs_for_generation`` repeating global tensors too (a method, or a
    staticmethod as in older transformers); ``position_ids`` is left to transformers, which
    repeats it on its own batch axis."""
    name = "_expand_inputs_for_generation"
    static = isinstance(inspect.getattr_static(cls, name), staticmethod)
    original = getattr(cls, name)

    def expand(*args, **model_kwargs):
        head = args[1:] if not static else args   # (self,) then the arguments
        expand_size, is_encoder_decoder, input_ids = _bound(head, model_kwargs)
        if expand_size != 1:
            for key, value in model_kwargs.items():
                if key != "position_ids":
                    model_kwargs[key] = _repeated(value, expand_size)
            outputs = model_kwargs.get("encoder_outputs")
            if is_encoder_decoder and outputs is not None and hasattr(outputs, "keys"):
                for key in list(outputs.keys()):
                    outputs[key] = _repeated(outputs[key], expand_size)
        return original(*args[:len(args) - len(head)], expand_size, is_encoder_decoder,
                        input_ids, **model_kwargs)
    expand.__name__ = expand.__qualname__ = name
    expand.__doc__ = original.__doc__
    return staticmethod(expand) if static else expand


def _bound(head: tuple, kwargs: dict) -> tuple:
    """``(expand_size, is_encoder_decoder, input_ids)`` from positional ``head`` and keywords
    (taken out of ``kwargs``), with transformers' defaults."""
    values = list(head) + [None] * (3 - len(head))
    for i, (key, default) in enumerate((("expand_size", 1), ("is_encoder_decoder", False),
                                        ("input_ids", None))):
        if i >= len(head):
            values[i] = kwargs.pop(key, default)
    return tuple(values)


def generating(cls: type):
    """``cls.generate`` with each forward's outputs moved to the placement of ``input_ids``
    (a global tensor) where they are on another one."""
    original = cls.generate

    def generate(self, *args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, GlobalTensor):
            return original(self, *args, **kwargs)
        home = ids.placement
        handle = self.register_forward_hook(lambda module, inputs, out: _homed(out, home))
        try:
            return original(self, *args, **kwargs)
        finally:
            handle.remove()
    generate.__name__ = generate.__qualname__ = "generate"
    generate.__doc__ = original.__doc__
    return generate


def _homed(output, home):
    """``output`` (a transformers ModelOutput, dict-like) with its global tensors but the cache
    on ``home``; None (keep it) for any other output."""
    if not hasattr(output, "keys"):
        return None
    for key in list(output.keys()):
        value = output[key]
        if key in _CACHES:
            _reorders_on_stages(value)
        elif isinstance(value, GlobalTensor) and value.placement != home:
            output[key] = value.to_global(placement=home, sbp=(B,) * home.ndim)
    return output


def _reorders_on_stages(cache) -> None:
    """Beam search reorders ``cache`` (a transformers Cache of layers) by the beams' indices,
    given on the ids' placement: each layer takes them on its own (an instance method, so
    transformers' checks of the class see nothing new)."""
    layers = getattr(cache, "layers", None)
    if layers is None or "reorder_cache" in getattr(cache, "__dict__", {"reorder_cache": 0}):
        return

    def reorder_cache(beam_idx) -> None:
        for layer in layers:
            keys = getattr(layer, "keys", None)
            here = keys.placement if isinstance(keys, GlobalTensor) else None
            moved = here is not None and isinstance(beam_idx, GlobalTensor) and \
                here != beam_idx.placement
            layer.reorder_cache(beam_idx.to_global(placement=here, sbp=(B,) * here.ndim)
                                if moved else beam_idx)
    cache.reorder_cache = reorder_cache

