"""Train a small character-level GPT on a generated English-like corpus, in any layout.

    python examples/gpt.py --layout 2d              # 4 simulated ranks (threads), 2x2 mesh
    python examples/gpt.py --layout tp --seconds 30
    sbpflow run -n 4 --backend torch examples/gpt.py --layout dp    # gloo processes
    torchrun --nproc-per-node 4 examples/gpt.py --layout 2d

Layouts: dp (parameters B, tokens S(0)), tp (Megatron column -> row, tokens B),
2d (2-D mesh: data parallel across groups, Megatron inside), zero (parameters S(0)),
replicated. Prints a sample of generated text at the end.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `sbpflow run` runs us by path

import common  # noqa: E402
import sbpflow as sf  # noqa: E402
from sbpflow.models import CharData, char_corpus, generate, gpt_class, param_count  # noqa: E402


def main(args):
    data = CharData(char_corpus(seed=args.seed), args.seq, args.batch, seed=args.seed)
    lay = common.get_layout("gpt", args)
    sf.manual_seed(args.seed)
    model = gpt_class(sf.nn, sf.nn.functional)(data.vocab, args.d, args.heads, args.layers,
                                                args.seq)
    sf.parallel.apply(model, lay.placement, lay.rules)
    opt = sf.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    pos = sf.arange(args.seq, placement=lay.placement, sbp=(sf.B,) * lay.placement.ndim)
    if common.on_rank0():
        print(f"GPT: {param_count(model)} parameters (d={args.d}, heads={args.heads}, "
              f"layers={args.layers}, vocab={data.vocab}), seq {args.seq}, batch {args.batch}; "
              f"{lay.describe()}")

    def batch(step):
        x, y = data.batch(step)
        return sf.tensor(x, lay.placement, lay.data_sbp), pos, \
            sf.tensor(y, lay.placement, lay.data_sbp)

    res = common.train(model, opt, batch, args, per_step=args.batch * args.seq, unit="tok",
                       desc=f"gpt {args.layout}")
    text = generate(model, data, lay.placement, "the ", args.sample) if args.sample else ""
    if common.on_rank0() and text:
        print(f"  sample: {text!r}")
    return res


if __name__ == "__main__":
    p = common.parser(__doc__.splitlines()[0], layout_default="2d", steps=300, batch=16, lr=3e-3)
    p.add_argument("--d", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--sample", type=int, default=60, help="characters to generate at the end")
    common.run(main, p.parse_args())
