"""Train Wide & Deep on synthetic click data, with the embedding table split over its vocabulary.

    python examples/wide_deep.py --layout tp     # table split over vocab rows (partial sums)
    python examples/wide_deep.py --layout 2d     # data parallel x vocab-parallel
    sbpflow run -n 4 --backend torch examples/wide_deep.py --layout dp
    python examples/wide_deep.py --layout tp --graph   # each step one sf.nn.Graph call

Layouts: dp, tp (embedding S(0) over the vocabulary, deep MLP column -> row), 2d, zero,
replicated. Labels come from a hidden rule on the ids and dense features, so the model can
learn them; prints the accuracy on fresh samples at the end.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `sbpflow run` runs us by path

import common  # noqa: E402
import sbpflow as sf  # noqa: E402
from sbpflow.models import param_count, wide_deep_class  # noqa: E402


def make_data(vocab: int, fields: int, dense: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    id_score = torch.randn(vocab, generator=g)            # the hidden rule
    dense_w = torch.randn(dense, generator=g)
    # skewed id frequencies, as in real click logs
    freq = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 0.8

    def batch(step: int, n: int):
        gs = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
        ids = torch.multinomial(freq, n * fields, replacement=True, generator=gs).reshape(n, fields)
        x = torch.randn(n, dense, generator=gs)
        y = (id_score[ids].sum(1) + x @ dense_w > 0).long()
        return ids, x, y
    return batch


def main(args):
    data = make_data(args.vocab, args.fields, args.dense, args.seed)
    lay = common.get_layout("wide_deep", args)
    sf.manual_seed(args.seed)
    model = wide_deep_class(sf.nn, sf.nn.functional, sf.cat)(args.vocab, args.dim, args.fields,
                                                             args.dense, args.hidden)
    sf.parallel.apply(model, lay.placement, lay.rules, zero=lay.zero)
    opt = sf.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if common.on_rank0():
        print(f"Wide&Deep: {param_count(model)} parameters (table {args.vocab}x{args.dim}), "
              f"batch {args.batch}; {lay.describe()}; embedding.weight "
              f"{sf.sbp.format_nd_sbp(model.embedding.weight.sbp)}")

    def batch(step):
        return tuple(sf.tensor(v, lay.placement, lay.data_sbp) for v in data(step, args.batch))

    res = common.train(model, opt, batch, args, per_step=args.batch,
                       desc=f"wide_deep {args.layout}")
    ids, x, y = data(-1, 1024)
    logits = model(sf.tensor(ids, lay.placement, lay.data_sbp),
                   sf.tensor(x, lay.placement, lay.data_sbp))
    return res, common.accuracy(logits, y, "1024 fresh samples")


def arguments() -> argparse.ArgumentParser:
    p = common.parser(__doc__.splitlines()[0], layout_default="tp", steps=300, batch=128,
                      lr=1e-2)
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--dense", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    return p


if __name__ == "__main__":
    common.run(main, arguments().parse_args())
