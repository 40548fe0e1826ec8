"""Example models, written once against a ``torch.nn``-like namespace, their layouts by name,
and a small generated text corpus (used by ``examples/`` and ``sbpflow demo``).

``gpt_class(nn, F)`` etc. return the model class for a namespace: ``sbpflow.nn`` gives the
distributed model, ``torch.nn`` its single-device twin (same parameter names and shapes, so
``state_dict``s move between them and tests compare the two)::

    GPT = gpt_class(sf.nn, sf.nn.functional)        # global tensors, any layout
    TorchGPT = gpt_class(torch.nn, torch.nn.functional)

``layout(model, name, world)`` gives the placement, input layout, parameter rules and ZeRO
stage (for `sf.parallel.apply`) of a named layout: ``dp``, ``tp``, ``2d``, ``zero`` (ZeRO-3),
``zero1``, ``zero2``, ``row_split``, ``replicated``. Models get their ops from the namespace
they are built with; this module imports only ``sbp``, ``placement``, ``tensor``.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import torch

from .placement import Placement, placement as _placement
from .sbp import B, S
from .utils import renamed

__all__ = ["gpt_class", "mlp_class", "vgg_class", "wide_deep_class", "param_count",
           "LAYOUT_NAMES", "ZERO_STAGES", "TP_RULES", "NamedLayout", "layout", "char_corpus",
           "CharData", "generate"]


# -- models -------------------------------------------------------------------------------------
def gpt_class(nn, F):
    """A small GPT: token + position embeddings, pre-LN blocks (causal attention, GELU MLP),
    final LayerNorm and an LM head. ``forward(tokens, positions, targets=None)`` returns the
    logits, or the mean cross-entropy when ``targets`` is given.

    The qkv projection's output features are ordered (head, q|k|v, head_dim), so splitting them
    (Megatron column parallel) gives each rank whole heads when the ranks divide the heads.

    Not split: the four classes are one model definition, read top-down as a torch model file
    is; each is short, and factories per class would only pass ``nn`` and ``F`` around.
    """

    class CausalSelfAttention(nn.Module):
        def __init__(self, d: int, heads: int, dropout: float) -> None:
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.dropout = dropout

        def forward(self, x):
            b, t, d = x.shape
            dh = d // self.heads
            # -1 heads: the same code runs on local shards (torch tensor parallel) and on
            # global tensors (sbpflow), where the shape is logical
            qkv = self.qkv(x).reshape(b, t, -1, 3, dh)
            q, k, v = (qkv[:, :, :, i, :].transpose(1, 2) for i in range(3))  # (b, h, t, dh)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(b, t, -1)
            return self.proj(y)

    class MLP(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc = nn.Linear(d, 4 * d)
            self.act = nn.GELU()
            self.proj = nn.Linear(4 * d, d)

        def forward(self, x):
            return self.proj(self.act(self.fc(x)))

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, dropout: float) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = CausalSelfAttention(d, heads, dropout)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = MLP(d)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, vocab: int = 256, d: int = 128, heads: int = 4, layers: int = 2,
                     seq: int = 64, dropout: float = 0.0) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList([Block(d, heads, dropout) for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, tokens, positions, targets=None):
            x = self.tok(tokens) + self.pos(positions)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            if targets is None:
                return logits
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT


def mlp_class(nn, F):
    """An MLP classifier: Linear → ReLU → ... → Linear; ``forward(x, y=None)``."""

    class MLP(nn.Module):
        def __init__(self, sizes=(64, 128, 128, 10)) -> None:
            super().__init__()
            layers = []
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                layers.append(nn.Linear(a, b))
                if i < len(sizes) - 2:
                    layers.append(nn.ReLU())
            self.net = nn.Sequential(*layers)

        def forward(self, x, y=None):
            logits = self.net(x)
            return logits if y is None else F.cross_entropy(logits, y)

    return MLP


def vgg_class(nn, F):
    """A small VGG-style CNN for 3×H×W images: conv-relu-conv-relu-pool blocks, then an MLP."""

    class VGG(nn.Module):
        def __init__(self, channels=(3, 8, 16), image: int = 16, classes: int = 10,
                     hidden: int = 32) -> None:
            super().__init__()
            layers = []
            for a, b in zip(channels[:-1], channels[1:]):
                layers += [nn.Conv2d(a, b, 3, padding=1), nn.ReLU(),
                           nn.Conv2d(b, b, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            self.features = nn.Sequential(*layers)
            side = image // 2 ** (len(channels) - 1)
            self.classifier = nn.Sequential(nn.Flatten(),
                                            nn.Linear(channels[-1] * side * side, hidden),
                                            nn.ReLU(), nn.Linear(hidden, classes))

        def forward(self, x, y=None):
            logits = self.classifier(self.features(x))
            return logits if y is None else F.cross_entropy(logits, y)

    return VGG


def wide_deep_class(nn, F, cat):
    """Wide & Deep: a wide linear part on dense features plus a deep part on embeddings of
    sparse ids (one big table, the one to split over its vocabulary). ``cat`` is
    ``torch.cat`` or ``sf.cat``."""

    class WideDeep(nn.Module):
        def __init__(self, vocab: int = 1000, dim: int = 16, fields: int = 4, dense: int = 8,
                     hidden: int = 64) -> None:
            super().__init__()
            self.embedding = nn.Embedding(vocab, dim)
            self.wide = nn.Linear(dense, 2)
            self.deep = nn.Sequential(nn.Linear(fields * dim + dense, hidden), nn.ReLU(),
                                      nn.Linear(hidden, 2))

        def forward(self, ids, dense, y=None):
            e = self.embedding(ids)                      # (batch, fields, dim)
            e = e.reshape(e.shape[0], -1)
            logits = self.wide(dense) + self.deep(cat([e, dense], dim=-1))
            return logits if y is None else F.cross_entropy(logits, y)

    return WideDeep


def param_count(model) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())


# -- layouts by name ----------------------------------------------------------------------------
LAYOUT_NAMES = ("dp", "tp", "2d", "zero", "zero1", "zero2", "row_split", "replicated")
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero": 3}   # data parallel with ZeRO

# 1-D tensor-parallel rules per model: Megatron column (S(0): output features) then row
# (S(1): input features, its output a partial sum) parallel pairs; the rest replicated.
TP_RULES = {
    "gpt": {"*.attn.qkv.*": S(0), "*.attn.proj.weight": S(1), "*.mlp.fc.*": S(0),
            "*.mlp.proj.weight": S(1), "*": B},
    # hidden layers column then row; the last layer column parallel: class-split logits
    # (cross_entropy's model-parallel softmax)
    "mlp": {"net.0.*": S(0), "net.2.weight": S(1), "net.4.*": S(0), "*": B},
    # convs: output channels then input channels; classifier column then row
    "vgg": {"features.0.*": S(0), "features.2.weight": S(1), "features.5.*": S(0),
            "features.7.weight": S(1), "classifier.1.*": S(0), "classifier.3.weight": S(1),
            "*": B},
    # the embedding table split over its vocabulary (each rank looks up its rows: a partial
    # sum), the deep MLP column then row parallel
    "wide_deep": {"embedding.weight": S(0), "deep.0.*": S(0), "deep.2.weight": S(1), "*": B},
}


class NamedLayout(NamedTuple):
    """A named layout: the mesh, the nd-sbp of the inputs (batch on axis 0), the parameter
    rules and the ZeRO stage: ``sf.parallel.apply(model, lay.placement, lay.rules,
    zero=lay.zero)``."""

    name: str
    placement: Placement
    data_sbp: tuple
    rules: dict
    zero: int = 0

    def describe(self) -> str:
        from .sbp import format_nd_sbp
        shape = self.placement.shape
        mesh = f"1-D mesh of {shape[0]}" if len(shape) == 1 else \
            "x".join(str(n) for n in shape) + " mesh"
        data = repr(self.data_sbp[0]) if len(self.data_sbp) == 1 else format_nd_sbp(self.data_sbp)
        zero = f", ZeRO stage {self.zero}" if self.zero else ""
        return f"layout {self.name} on a {mesh}, inputs {data}{zero}"


def layout(model: str, name: str, world: int = 4) -> NamedLayout:
    """The layout ``name`` of ``model`` (a key of `TP_RULES`) on ``world`` ranks:

    * ``dp``: 1-D mesh, parameters B, inputs split on the batch S(0) (gradients all-reduced);
    * ``tp``: 1-D mesh, the model's Megatron rules (`TP_RULES`), inputs B;
    * ``2d``: a (world/2)×2 mesh: data parallel across groups, tensor parallel inside a group
      (rules ``(B, tp)``), inputs ``(S(0), B)``;
    * ``zero``, ``zero1``, ``zero2``: ``dp`` with ZeRO stage 3, 1, 2 (docs/zero.md: parameters,
      gradients and optimizer state stored split S(0), gathered B for compute);
    * ``row_split``: 1-D mesh, every parameter (and so its optimizer state) split S(0) and
      computed so (the dispatch picks the ops' signatures for split weights), inputs S(0);
    * ``replicated``: 1-D mesh, everything B (every rank computes everything).
    """
    if model not in TP_RULES:
        raise ValueError(f"unknown model {model!r}; one of {sorted(TP_RULES)}")
    line = _placement("cpu", list(range(world)))
    if name == "dp":
        return NamedLayout(name, line, (S(0),), {"*": B})
    if name == "tp":
        return NamedLayout(name, line, (B,), dict(TP_RULES[model]))
    if name == "2d":
        if world % 2 or world < 4:
            raise ValueError(f"layout '2d' needs an even number of ranks >= 4, not {world}")
        mesh = _placement("cpu", [list(range(i, i + 2)) for i in range(0, world, 2)])
        return NamedLayout(name, mesh, (S(0), B),
                           {k: (B, v) for k, v in TP_RULES[model].items()})
    if name in ZERO_STAGES:
        return NamedLayout(name, line, (S(0),), {"*": B}, ZERO_STAGES[name])
    if name == "row_split":
        return NamedLayout(name, line, (S(0),), {"*": S(0)})
    if name == "replicated":
        return NamedLayout(name, line, (B,), {"*": B})
    raise ValueError(f"unknown layout {name!r}; one of {LAYOUT_NAMES}")


# -- a small generated corpus ---------------------------------------------------------------------
_WORDS = {
    "det": ["the", "a", "one", "every", "that"],
    "adj": ["small", "old", "red", "quick", "quiet", "brave", "green", "lazy", "happy", "tiny"],
    "noun": ["cat", "dog", "bird", "fox", "king", "robot", "child", "horse", "frog", "queen",
             "wizard", "farmer"],
    "verb": ["sees", "likes", "chases", "finds", "helps", "follows", "feeds", "meets", "paints",
             "visits"],
    "adv": ["slowly", "today", "again", "at night", "in the garden", "by the river", "quietly"],
    "conj": ["and", "but", "so", "while"],
}


def _phrase(rng: random.Random) -> str:
    words = [rng.choice(_WORDS["det"])]
    if rng.random() < 0.5:
        words.append(rng.choice(_WORDS["adj"]))
    words.append(rng.choice(_WORDS["noun"]))
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    clause = f"{_phrase(rng)} {rng.choice(_WORDS['verb'])} {_phrase(rng)}"
    if rng.random() < 0.4:
        clause += " " + rng.choice(_WORDS["adv"])
    if rng.random() < 0.3:
        clause += f" {rng.choice(_WORDS['conj'])} {_phrase(rng)} {rng.choice(_WORDS['verb'])} " \
                  f"{_phrase(rng)}"
    return clause + "."


def char_corpus(chars: int = 200_000, seed: int = 0) -> str:
    """A deterministic English-like text of about ``chars`` characters, from a tiny grammar
    (determiner, adjective, noun, verb ... sentences): learnable structure at the character
    and the word level, no download."""
    rng = random.Random(seed)
    lines, n = [], 0
    while n < chars:
        line = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines) + "\n"


class CharData:
    """Character-level language-model batches from a text: ``batch(step)`` gives the same
    (tokens, targets) — int64 tensors of shape (batch, seq), targets shifted by one — for the
    same step on every rank (each rank then keeps its shard with `sf.tensor`)."""

    def __init__(self, text: str, seq: int, batch: int, seed: int = 0) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.int64)
        self.seq, self.batch_size, self.seed = seq, batch, seed

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in s], dtype=torch.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.seq - 1, (self.batch_size,), generator=g)
        rows = torch.stack([self.data[s:s + self.seq + 1] for s in starts.tolist()])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def generate(model, data: CharData, placement: Placement, prompt: str, n: int) -> str:
    """Greedy continuation of ``prompt`` by a GPT laid out on ``placement`` (every rank calls
    it). The model always sees a window of ``data.seq`` tokens, right-padded (causal attention
    hides the padding from the positions before it), so every call has the training shapes
    and reuses the signatures already chosen."""
    from .tensor import arange, tensor
    ids = data.encode(prompt).tolist()
    bsbp = (B,) * placement.ndim
    pos = arange(data.seq, placement=placement, sbp=bsbp)
    for _ in range(n):
        ctx = ids[-data.seq:]
        window = torch.tensor(ctx + [0] * (data.seq - len(ctx)))
        logits = model(tensor(window[None], placement, bsbp), pos).full_tensor()
        ids.append(int(logits[0, len(ctx) - 1].argmax()))
    return data.decode(ids)


__getattr__ = renamed(__name__, {"Layout": "NamedLayout"})  # sf.Layout is the (placement, sbp)
