"""``sf.auto.model_graphs``: paper-scale models built directly as `LayerGraph`s (shapes and flops
only, no weights), for the search; the runnable models are ``sbpflow.models``.

Residual adds and layer norms are folded away (they are elementwise and follow the layout of the
layer before them); they do make the inputs of the next layer nonlinear in the previous output,
so those layers do not accept a partial sum (``accepts_partial=False``).
"""

from __future__ import annotations

import dataclasses

from ..errors import SearchInputError
from .checks import check_heads, positive_size
from .layer_graph import LayerGraph, Layer

__all__ = ["gpt", "vgg13", "alexnet", "dlrm", "mlp", "linear_layer"]


def _sizes(model: str, **sizes) -> None:
    """Each of ``sizes`` is an int >= 1 (`SearchInputError` naming the first that is not)."""
    for name, value in sizes.items():
        positive_size(f"sf.auto.model_graphs.{model}", name, value)


def linear_layer(name, tokens, d_in, d_out, accepts_partial=False, **attrs) -> Layer:
    """A linear layer: input ``(tokens, d_in)``, weight ``(d_in, d_out)`` (the transpose of
    torch's), output ``(tokens, d_out)``."""
    return Layer(name, "linear", (tokens, d_in), (d_in, d_out), (tokens, d_out),
                 2.0 * tokens * d_in * d_out, accepts_partial, attrs)


def gpt(layers: int = 12, d_model: int = 768, heads: int = 12, seq: int = 1024, batch: int = 8,
        vocab: int = 50257, itemsize: int = 2, tied: bool = False) -> LayerGraph:
    """A GPT decoder: token embedding, per block qkv / attention / proj / fc1 / fc2, LM head
    (``tied``: the head uses the embedding's weight, as GPT-2's; it then has none of its own).

    Tokens are ``batch * seq`` (axis 0 of every activation); splitting axis 0 of the attention
    is allowed only along whole sequences (``batch`` bounds it), splitting its axis 1 only along
    whole heads. Every size is an int >= 1 and ``heads`` divides ``d_model``, else
    `SearchInputError` naming the argument.
    """
    _sizes("gpt", layers=layers, d_model=d_model, heads=heads, seq=seq, batch=batch,
           vocab=vocab, itemsize=itemsize)
    check_heads("sf.auto.model_graphs.gpt", heads, d_model)
    t, d = batch * seq, d_model
    out = [Layer("embed", "embedding", (t,), (vocab, d), (t, d), 2.0 * t * d, False,
                 {"megatron": "vocab"})]
    for i in range(layers):
        out += [
            linear_layer(f"h{i}.qkv", t, d, 3 * d, megatron="col"),
            Layer(f"h{i}.attn", "attention", (t, 3 * d), None, (t, d),
                  4.0 * batch * seq * seq * d, False,
                  {"batch": batch, "heads": heads, "megatron": "heads"}),
            linear_layer(f"h{i}.proj", t, d, d, megatron="row"),
            linear_layer(f"h{i}.fc1", t, d, 4 * d, megatron="col"),
            linear_layer(f"h{i}.fc2", t, 4 * d, d, megatron="row"),
        ]
    head = linear_layer("head", t, d, vocab, megatron="col")
    out.append(dataclasses.replace(head, weight_shape=None, tied="embed") if tied else head)
    return LayerGraph(out, name=f"gpt-{layers}x{d_model}", itemsize=itemsize)


def _conv(name, n, cin, cout, hw_in, hw_out, k):
    flops = 2.0 * n * cout * cin * k * k * hw_out * hw_out
    return Layer(name, "conv", (n, cin, hw_in, hw_in), (cout, cin, k, k),
                 (n, cout, hw_out, hw_out), flops, False, {"megatron": "outch"})


def _pool(name, n, c, hw_in, hw_out):
    return Layer(name, "pool", (n, c, hw_in, hw_in), None, (n, c, hw_out, hw_out),
                 1.0 * n * c * hw_in * hw_in, False, {"megatron": "ch"})


def vgg13(batch: int = 64, num_classes: int = 1000, itemsize: int = 2) -> LayerGraph:
    """VGG-13 on 224 x 224 images (sizes are ints >= 1, else `SearchInputError`)."""
    _sizes("vgg13", batch=batch, num_classes=num_classes, itemsize=itemsize)
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]
    layers, c, hw, i = [], 3, 224, 0
    for v in cfg:
        if v == "M":
            layers.append(_pool(f"pool{i}", batch, c, hw, hw // 2))
            hw //= 2
        else:
            i += 1
            layers.append(_conv(f"conv{i}", batch, c, v, hw, hw, 3))
            c = v
    layers += [linear_layer("fc1", batch, c * hw * hw, 4096, megatron="col"),
               linear_layer("fc2", batch, 4096, 4096, megatron="row"),
               linear_layer("fc3", batch, 4096, num_classes, megatron="col")]
    return LayerGraph(layers, name="vgg13", itemsize=itemsize)


def alexnet(batch: int = 128, num_classes: int = 1000, itemsize: int = 2) -> LayerGraph:
    """AlexNet on 224 x 224 images (sizes are ints >= 1, else `SearchInputError`)."""
    _sizes("alexnet", batch=batch, num_classes=num_classes, itemsize=itemsize)
    n = batch
    layers = [
        _conv("conv1", n, 3, 64, 224, 55, 11), _pool("pool1", n, 64, 55, 27),
        _conv("conv2", n, 64, 192, 27, 27, 5), _pool("pool2", n, 192, 27, 13),
        _conv("conv3", n, 192, 384, 13, 13, 3),
        _conv("conv4", n, 384, 256, 13, 13, 3),
        _conv("conv5", n, 256, 256, 13, 13, 3), _pool("pool5", n, 256, 13, 6),
        linear_layer("fc1", n, 256 * 6 * 6, 4096, megatron="col"),
        linear_layer("fc2", n, 4096, 4096, megatron="row"),
        linear_layer("fc3", n, 4096, num_classes, megatron="col"),
    ]
    return LayerGraph(layers, name="alexnet", itemsize=itemsize)


def dlrm(batch: int = 2048, dense: int = 13, tables: int = 26, rows: int = 1_000_000,
         dim: int = 128, bottom=(512, 256, 128), top=(1024, 1024, 512, 256, 1),
         itemsize: int = 4) -> LayerGraph:
    """DLRM-like: stacked embedding tables and a bottom MLP both feed the feature interaction
    (an in-tree), then the top MLP. ``bottom[-1]`` must equal ``dim``; sizes are ints >= 1
    (else `SearchInputError`)."""
    _sizes("dlrm", batch=batch, dense=dense, tables=tables, rows=rows, dim=dim,
           itemsize=itemsize)
    for name, widths in (("bottom", bottom), ("top", top)):
        for w in widths:
            positive_size("sf.auto.model_graphs.dlrm", f"each width of {name}", w)
    if bottom[-1] != dim:
        raise ValueError("the bottom MLP must end at the embedding dim")
    n = batch
    layers = [Layer("emb", "embedding", (n, tables), (tables * rows, dim), (n, tables * dim),
                    2.0 * n * tables * dim, False, {"megatron": "vocab"})]
    d = dense
    for i, w in enumerate(bottom):
        layers.append(linear_layer(f"bot{i}", n, d, w, megatron="col" if i % 2 == 0 else "row"))
        d = w
    f = tables + 1
    inter_out = f * (f - 1) // 2 + dim
    layers.append(Layer("interact", "interaction", (n, f * dim), None, (n, inter_out),
                        2.0 * n * f * f * dim, False, {"megatron": "rep"}))
    d = inter_out
    for i, w in enumerate(top):
        layers.append(linear_layer(f"top{i}", n, d, w, megatron="col" if i % 2 == 0 else "row"))
        d = w
    names = [l.name for l in layers]
    nb = len(bottom)
    edges = [("emb", "interact")]
    edges += [(names[1 + i], names[2 + i]) for i in range(nb)]        # bottom chain -> interact
    edges += [(names[1 + nb + i], names[2 + nb + i]) for i in range(len(top))]
    return LayerGraph(layers, edges, name="dlrm", itemsize=itemsize)


def mlp(sizes=(1024, 4096, 1024), batch: int = 64, activation: bool = True,
        itemsize: int = 4) -> LayerGraph:
    """A chain of linears. Without an activation the layers are a product of matrices, so a
    partial-sum output may flow into the next layer unreduced. ``sizes``: at least two
    widths, each an int >= 1 (else `SearchInputError`)."""
    _sizes("mlp", batch=batch, itemsize=itemsize)
    if len(sizes) < 2:
        raise SearchInputError(f"sf.auto.model_graphs.mlp: sizes must hold at least two "
                               f"widths (input, output), got {sizes!r}")
    for w in sizes:
        positive_size("sf.auto.model_graphs.mlp", "each width of sizes", w)
    layers = [linear_layer(f"fc{i}", batch, a, b, accepts_partial=(not activation and i > 0),
                      megatron="col" if i % 2 == 0 else "row")
              for i, (a, b) in enumerate(zip(sizes, sizes[1:]))]
    return LayerGraph(layers, name="mlp", itemsize=itemsize)
