"""Train a small VGG-style CNN on synthetic images (noisy class prototypes), in any layout.

    python examples/vgg.py --layout dp
    python examples/vgg.py --layout tp    # conv output channels, then input channels (partial sums)
    sbpflow run -n 4 --backend torch examples/vgg.py --layout 2d
    python examples/vgg.py --layout dp --graph    # each step one sf.nn.Graph call

Layouts: dp, tp (convs and classifier in Megatron pairs), 2d, zero, replicated.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `sbpflow run` runs us by path

import common  # noqa: E402
import sbpflow as sf  # noqa: E402
from sbpflow.models import param_count, vgg_class  # noqa: E402

CLASSES = 10


def make_data(image: int, seed: int):
    """``batch(step, n)``: ``n`` images of class-specific smooth patterns plus noise."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(CLASSES, 3, 4, 4, generator=g)
    protos = torch.nn.functional.interpolate(coarse, size=(image, image), mode="bilinear",
                                             align_corners=False)

    def batch(step: int, n: int):
        gs = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
        y = torch.randint(0, CLASSES, (n,), generator=gs)
        x = protos[y] + 3.0 * torch.randn(n, 3, image, image, generator=gs)
        return x, y
    return batch


def main(args):
    data = make_data(args.image, args.seed)
    lay = common.get_layout("vgg", args)
    sf.manual_seed(args.seed)
    channels = (3,) + tuple(args.channels)
    model = vgg_class(sf.nn, sf.nn.functional)(channels, args.image, CLASSES)
    sf.parallel.apply(model, lay.placement, lay.rules, zero=lay.zero)
    opt = sf.optim.AdamW(model.parameters(), lr=args.lr)
    if common.on_rank0():
        print(f"VGG: {param_count(model)} parameters, channels {channels}, "
              f"{args.image}x{args.image} images, batch {args.batch}; {lay.describe()}")

    def batch(step):
        x, y = data(step, args.batch)
        return sf.tensor(x, lay.placement, lay.data_sbp), sf.tensor(y, lay.placement, lay.data_sbp)

    res = common.train(model, opt, batch, args, per_step=args.batch, desc=f"vgg {args.layout}")
    x, y = data(-1, 256)  # held out: a step the training never draws
    acc = common.accuracy(model(sf.tensor(x, lay.placement, lay.data_sbp)), y,
                          "256 fresh images")
    return res, acc


def arguments() -> argparse.ArgumentParser:
    p = common.parser(__doc__.splitlines()[0], steps=100, batch=32, lr=3e-3)
    p.add_argument("--image", type=int, default=16)
    p.add_argument("--channels", type=int, nargs=2, default=(8, 16))
    return p


if __name__ == "__main__":
    common.run(main, arguments().parse_args())
