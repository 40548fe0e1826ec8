"""Train a small character-level GPT on a generated English-like corpus, in any layout.

    python examples/gpt.py --layout 2d              # 4 simulated ranks (threads), 2x2 mesh
    python examples/gpt.py --layout tp --seconds 30
    python examples/gpt.py --layout dp --graph      # each step one sf.nn.Graph call
    python examples/gpt.py --layout pp --timeline pp.png      # 4 stages, 1F1B, 8 micro-batches
    python examples/gpt.py --layout pp-dp --schedule gpipe    # 2 stages x 2-way data parallel
    sbpflow run -n 4 --backend torch examples/gpt.py --layout dp    # gloo processes
    torchrun --nproc-per-node 4 examples/gpt.py --layout 2d

Layouts: dp (parameters B, tokens S(0)), tp (Megatron column -> row, tokens B),
2d (2-D mesh: data parallel across groups, Megatron inside), zero (parameters S(0)),
replicated; pp (one single-rank stage a rank, `sf.parallel.pipeline`) and pp-dp (stages of
two data-parallel ranks), which run in graph mode (``--eager``: the stages one after another).
Prints a sample of generated text at the end.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `sbpflow run` runs us by path

import common  # noqa: E402
import sbpflow as sf  # noqa: E402
from sbpflow.models import (LAYOUT_NAMES, CharData, char_corpus, generate,  # noqa: E402
                            gpt_class, param_count)

DEFAULT_LAYERS = 2
DEFAULT_PIPELINE_LAYERS = 4  # one block a stage on 4 ranks


def split_points(layers: int, stages: int) -> list:
    """Where `sf.parallel.pipeline` cuts a GPT of ``layers`` blocks into ``stages``: before
    evenly spaced blocks, or, with fewer blocks than stages, before every block and ``ln_f``
    (stage 0 always holds the embeddings, the last stage ``ln_f`` and the head)."""
    if layers >= stages:
        return [f"blocks.{i * layers // stages}" for i in range(1, stages)]
    cuts = [f"blocks.{i}" for i in range(layers)] + ["ln_f"]
    if stages - 1 > len(cuts):
        raise SystemExit(f"a GPT of {layers} blocks has at most {len(cuts) + 1} pipeline "
                         f"stages, not {stages}: use --layers {stages - 2} or more")
    return cuts[len(cuts) - (stages - 1):]


def build(args, vocab: int):
    """The GPT laid out by ``args.layout``: (model, placement of the inputs, their nd-sbp,
    a description of the layout)."""
    sf.manual_seed(args.seed)
    model = gpt_class(sf.nn, sf.nn.functional)(vocab, args.d, args.heads, args.layers, args.seq)
    if args.layout in common.PIPELINE_LAYOUTS:
        stages = common.pipeline_stages(args.layout, sf.world_size())
        split = split_points(args.layers, len(stages.placements))
        sf.parallel.pipeline(model, stages.placements, split=split)
        return model, stages.placements[0], stages.data_sbp, \
            f"{stages.describe()}, split before {', '.join(split)}"
    lay = common.get_layout("gpt", args)
    sf.parallel.apply(model, lay.placement, lay.rules, zero=lay.zero)
    return model, lay.placement, lay.data_sbp, lay.describe()


def main(args):
    data = CharData(char_corpus(seed=args.seed), args.seq, args.batch, seed=args.seed)
    model, where, data_sbp, described = build(args, data.vocab)
    opt = sf.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    pos = sf.arange(args.seq, placement=where, sbp=(sf.B,) * where.ndim)
    if common.on_rank0():
        print(f"GPT: {param_count(model)} parameters (d={args.d}, heads={args.heads}, "
              f"layers={args.layers}, vocab={data.vocab}), seq {args.seq}, batch {args.batch}; "
              f"{described}")

    def batch(step):
        x, y = data.batch(step)
        return sf.tensor(x, where, data_sbp), pos, sf.tensor(y, where, data_sbp)

    # positions go whole to every micro-batch (their axis 0 is seq, which may equal the batch)
    res = common.train(model, opt, batch, args, per_step=args.batch * args.seq, unit="tok",
                       desc=f"gpt {args.layout}", split_inputs=(True, False, True))
    text = generate(model, data, where, "the ", args.sample) if args.sample else ""
    if common.on_rank0() and text:
        print(f"  sample: {text!r}")
    return res


def arguments() -> argparse.ArgumentParser:
    p = common.parser(__doc__.splitlines()[0], layouts=LAYOUT_NAMES + common.PIPELINE_LAYOUTS,
                      layout_default="2d", steps=300, batch=16, lr=3e-3)
    p.add_argument("--d", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"transformer blocks (default {DEFAULT_LAYERS}; "
                        f"{DEFAULT_PIPELINE_LAYERS} for the pipeline layouts)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--sample", type=int, default=60, help="characters to generate at the end")
    return p


def parse(argv=None):
    args = arguments().parse_args(argv)
    if args.layers is None:
        args.layers = DEFAULT_PIPELINE_LAYERS if args.layout in common.PIPELINE_LAYOUTS \
            else DEFAULT_LAYERS
    return args


if __name__ == "__main__":
    common.run(main, parse())
