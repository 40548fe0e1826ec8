"""Train an MLP on scikit-learn's bundled 8x8 digits (no download), in any layout.

    python examples/mlp_digits.py --layout dp
    python examples/mlp_digits.py --layout tp      # class-split logits: model-parallel softmax
    sbpflow run -n 4 --backend torch examples/mlp_digits.py --layout zero
    python examples/mlp_digits.py --layout 2d --graph --micro-batches 4   # graph mode

Layouts: dp, tp (64 -> 128 column, 128 -> 128 row, 128 -> 10 column), 2d, zero, replicated.
Prints the test accuracy at the end.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `sbpflow run` runs us by path

import common  # noqa: E402
import sbpflow as sf  # noqa: E402
from sbpflow.models import mlp_class, param_count  # noqa: E402


def load(seed: int):
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def main(args):
    (xtr, ytr), (xte, yte) = load(args.seed)
    lay = common.get_layout("mlp", args)
    sf.manual_seed(args.seed)
    model = mlp_class(sf.nn, sf.nn.functional)((64, args.hidden, args.hidden, 10))
    sf.parallel.apply(model, lay.placement, lay.rules, zero=lay.zero)
    opt = sf.optim.AdamW(model.parameters(), lr=args.lr)
    if common.on_rank0():
        print(f"MLP: {param_count(model)} parameters, {len(xtr)} training / {len(xte)} test "
              f"digits, batch {args.batch}; {lay.describe()}")
    per_epoch = len(xtr) // args.batch

    def batch(step):
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(epoch))
        idx = order[i * args.batch:(i + 1) * args.batch]
        return sf.tensor(xtr[idx], lay.placement, lay.data_sbp), \
            sf.tensor(ytr[idx], lay.placement, lay.data_sbp)

    res = common.train(model, opt, batch, args, per_step=args.batch, desc=f"mlp {args.layout}")
    acc = common.accuracy(model(sf.tensor(xte, lay.placement, lay.data_sbp)), yte,
                          f"{len(xte)} digits", label="test accuracy")
    return res, acc


def arguments() -> argparse.ArgumentParser:
    p = common.parser(__doc__.splitlines()[0], steps=300, batch=64, lr=3e-3)
    p.add_argument("--hidden", type=int, default=128)
    return p


if __name__ == "__main__":
    common.run(main, arguments().parse_args())
