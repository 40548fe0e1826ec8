"""Hugging Face ``generate()`` on converted models: the one step of transformers' generation
that reads tensors by their Python type.

transformers repeats each tensor argument once per beam (or returned sequence) in
``_expand_inputs_for_generation`` only when it ``isinstance(v, torch.Tensor)``; a global tensor
is not one, so an ``attention_mask`` given as a global tensor kept its batch while the ids grew
(a `ShapeError` in beam search). `expanding` wraps that method of a converted class: global
tensors among the keyword arguments (and inside ``encoder_outputs``) are repeated along the
batch as transformers repeats torch tensors, then transformers' own method runs.
"""

from __future__ import annotations

import inspect

from ..tensor import GlobalTensor

__all__ = ["expanding"]


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
