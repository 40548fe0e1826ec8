"""Train a GPT written in plain PyTorch (examples/torch_gpt_model.py, unchanged) with sbpflow.

    python examples/nanogpt.py                      # 4 simulated ranks (threads), data parallel
    python examples/nanogpt.py --layout 2d          # 2x2 mesh: data parallel x tensor parallel
    python examples/nanogpt.py --layout 2d --steps 200 --sample 80
    python examples/nanogpt.py --layout tp-naive    # c_attn split by rows: warns, moves more

The torch model goes through ``sf.parallel.apply`` (converted by ``sf.nn.from_torch``, its
parameters laid out by name rules), then trains with ``sf.optim.AdamW`` on a generated
English-like corpus.
Every line of the model file runs as written: its torch calls on global tensors are sbpflow ops.
The training loop differs from a torch one only where a value must be read whole
(``loss.item()``, ``logits.full_tensor()``); see docs/torch_models.md, 'Porting checklist'.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sbpflow as sf  # noqa: E402
from sbpflow.models import CharData, char_corpus  # noqa: E402
from torch_gpt_model import GPT, GPTConfig  # noqa: E402

# name rules of sf.parallel.apply, per layout: (mesh shape, parameter rules, token layout).
# 2d: Megatron's MLP split inside each pair of ranks; c_attn stays whole (its output is cut
# into q | k | v: splitting its rows would gather it every step, and apply warns about it)
# tp-naive: Megatron's rules written for c_attn as for any column-parallel layer; its output is
# then cut into q | k | v across ranks (see the warning, and the bytes, against tp)
MLP_TP = {"*.mlp.c_fc.*": sf.parallel.colwise, "*.mlp.c_proj.*": sf.parallel.rowwise}
LAYOUTS = {
    "dp": ((4,), {"*": sf.B}, (sf.S(0),)),
    "2d": ((2, 2), {**MLP_TP, "*": (sf.B, sf.B)}, (sf.S(0), sf.B)),   # styles: on the last dim
    "tp": ((4,), {**MLP_TP, "*": sf.B}, (sf.B,)),
    "tp-naive": ((4,), {"*.attn.c_attn.*": sf.parallel.colwise, "*.attn.c_proj.*":
                        sf.parallel.rowwise, **MLP_TP, "*": sf.B}, (sf.B,)),
}


def arguments(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="dp")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sample", type=int, default=20, help="characters to generate at the end")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def mesh_of(shape: tuple) -> sf.Placement:
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(shape).tolist()
    return sf.placement("cpu", ranks)


def sample(model, data: CharData, mesh, prompt: str, n: int) -> str:
    """Greedy generation: the model's own ``targets=None`` path (``x[:, [-1], :]``), the
    logits read whole with ``full_tensor`` (torch.argmax has no sbpflow op)."""
    idx = data.encode(prompt)[None]
    model.eval()
    for _ in range(n):
        cond = idx[:, -model.config.block_size:]
        logits, _ = model(sf.tensor(cond, mesh, (sf.B,) * mesh.ndim))
        nxt = logits.full_tensor()[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], dim=1)
    model.train()
    return data.decode(idx[0])


def main(args, torch_model: torch.nn.Module, data: CharData):
    shape, rules, data_sbp = LAYOUTS[args.layout]
    mesh = mesh_of(shape)
    model = sf.parallel.apply(torch_model, mesh, rules)  # converted (sf.nn.from_torch), laid out
    opt = sf.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        if step == args.steps - 1:
            sf.comm.reset_stats()
        x, y = data.batch(step)
        _, loss = model(sf.tensor(x, mesh, data_sbp), sf.tensor(y, mesh, data_sbp))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if sf.rank() == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - t0
    sent = sf.comm.stats().sent  # this rank's bytes in the last step
    text = sample(model, data, mesh, "the ", args.sample) if args.sample else ""
    return losses, seconds, text, sent


def run(argv=None):
    args = arguments(argv)
    data = CharData(char_corpus(seed=args.seed), args.seq, args.batch, seed=args.seed)
    torch.manual_seed(args.seed)
    cfg = GPTConfig(block_size=args.seq, vocab_size=data.vocab, n_layer=args.layers,
                    n_head=args.heads, n_embd=args.d)
    torch_model = GPT(cfg)  # plain torch, built once; every rank converts it
    print(f"torch GPT: {torch_model.num_params()} parameters; layout {args.layout} on "
          f"{mesh_of(LAYOUTS[args.layout][0])} (4 simulated ranks: threads)")
    losses, seconds, text, sent = sf.launch(main, world_size=4,
                                            args=(args, torch_model, data))[0]
    print(f"{args.steps} steps in {seconds:.1f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"rank 0 sent {sent} bytes in the last step")
    if text:
        print(f"sample: {text!r}")
    return losses


if __name__ == "__main__":
    run()
