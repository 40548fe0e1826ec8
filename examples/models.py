"""The example models: one definition, in the package (``sbpflow.models``), re-exported here.

``gpt_class(nn, F)`` etc. build a model class for a namespace: ``sbpflow.nn`` gives the
distributed model, ``torch.nn`` its single-device twin (same parameter names)::

    import sbpflow as sf, torch
    GPT = gpt_class(sf.nn, sf.nn.functional)        # global tensors, any layout
    TorchGPT = gpt_class(torch.nn, torch.nn.functional)
"""

from sbpflow.models import (LAYOUT_NAMES, TP_RULES, CharData, Layout, char_corpus,  # noqa: F401
                            generate, gpt_class, layout, mlp_class, param_count, vgg_class,
                            wide_deep_class)

__all__ = ["gpt_class", "mlp_class", "vgg_class", "wide_deep_class", "param_count",
           "LAYOUT_NAMES", "TP_RULES", "Layout", "layout", "char_corpus", "CharData",
           "generate"]
