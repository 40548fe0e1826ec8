"""Cyclic Data Parallelism on scikit-learn's 8x8 digits (no download): the spec's MLP
64-128-128-64-10 cut into 4 stages (one Linear (+ReLU) each), 4 micro-batches of 16 a step,
heavy-ball SGD (lr 0.05, momentum 0.9) per stage, a stratified 80/20 split (1437 / 360).

    python examples/cdp_digits.py --rule v2 --mode single --epochs 60
    python examples/cdp_digits.py --rule v1 --mode pp --timeline cdp_pp.png
    python examples/cdp_digits.py --rule dp --mode dp --backend torch    # 4 gloo processes

Prints the loss per epoch (progress bar on stderr), the test accuracy, the trainer's stats,
and draws the first cycles of the executed schedule (--timeline). See docs/cdp.md.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `sbpflow run` runs us by path

import common  # noqa: E402
import sbpflow as sf  # noqa: E402
from sbpflow.parallel.cdp import MODES, RULES, ranks_needed, rules  # noqa: E402


def load(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    f = lambda a: torch.tensor(a, dtype=torch.float32) / 16.0  # noqa: E731
    return (f(xtr), torch.tensor(ytr)), (f(xte), torch.tensor(yte))


def model(dtype: torch.dtype) -> sf.nn.Sequential:
    L = lambda i, o: sf.nn.Linear(i, o, dtype=dtype)  # noqa: E731
    return sf.nn.Sequential(L(64, 128), sf.nn.ReLU(), L(128, 128), sf.nn.ReLU(),
                            L(128, 64), sf.nn.ReLU(), L(64, 10))


def _bar(total: int, desc: str, off: bool):
    if off or sf.rank() != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("(no progress bar: pip install tqdm)", file=sys.stderr)
        return None
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)


def main(args) -> dict:
    dtype = getattr(torch, args.dtype)
    (xtr, ytr), (xte, yte) = load(args.seed)
    xtr, xte = xtr.to(dtype), xte.to(dtype)
    sf.manual_seed(args.seed)
    net = model(dtype)
    trainer = sf.parallel.CyclicDataParallel(
        net, loss_fn=lambda out, y: sf.nn.functional.cross_entropy(out, y),
        optimizer=lambda ps: sf.optim.SGD(ps, lr=args.lr, momentum=0.9),
        rule=args.rule, mode=args.mode, split=(args.stages, "params"))
    batch = args.stages * args.micro_batch
    per_epoch = len(xtr) // batch
    bar = _bar(per_epoch * args.epochs, f"cdp {args.rule} {args.mode}", args.no_bar)
    epoch_losses = []
    for epoch in range(args.epochs):
        order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(
            args.seed * 1000 + epoch))
        got = []
        for s in range(per_epoch):
            idx = order[s * batch:(s + 1) * batch]
            got += trainer.step(xtr[idx], ytr[idx])
            if bar is not None:
                bar.update(1)
        got += trainer.flush() if epoch == args.epochs - 1 else []
        # each rank finished some workers' losses (the last stage's ranks): sum over the world
        total = sf.comm.current().all_reduce(
            torch.tensor([sum(v for _, _, v in got), float(len(got))], dtype=torch.float64),
            list(range(sf.world_size())))
        epoch_losses.append((total[0] / total[1]).item())
        if bar is not None:
            bar.set_postfix(loss=f"{epoch_losses[-1]:.4f}")
    if bar is not None:
        bar.close()
    state = trainer.state_dict()  # "{stage}.{name}": the Sequential's own names after the dot
    net.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()})
    world = sf.placement("cpu", list(range(sf.world_size())))
    logits = net(sf.tensor(xte, world, sf.B)).full_tensor()
    acc = (logits.argmax(-1) == yte).double().mean().item()
    stats = trainer.stats()
    if args.timeline:
        trainer.save_timeline(args.timeline)
    if sf.rank() == 0:
        keep = ("peak_live_activations", "peak_activation_bytes", "peak_param_bytes",
                "max_versions", "messages_per_step", "bytes_per_step",
                "max_grad_chunks_per_step")
        print(f"rule {args.rule}, mode {args.mode}: {args.epochs} epochs of {per_epoch} steps, "
              f"last epoch's mean loss {epoch_losses[-1]:.4f}")
        print(f"test accuracy {acc:.4f} on {len(xte)} digits")
        print("stats: " + ", ".join(f"{k} {stats[k]}" for k in keep))
        if args.timeline:
            print(f"timeline: {args.timeline}")
    return {"accuracy": acc, "losses": epoch_losses, "stats": stats}


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rule", choices=RULES, default="v2")
    p.add_argument("--mode", choices=MODES, default="single")
    p.add_argument("--epochs", type=common.positive(), default=30)
    p.add_argument("--lr", type=common.positive(float), default=0.05)
    p.add_argument("--stages", type=common.positive(), default=4, help="N: stages = micro-batches a step")
    p.add_argument("--micro-batch", type=common.positive(), default=16)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeline", default=None, help="draw the executed schedule to this PNG")
    p.add_argument("--backend", choices=["threads", "torch"], default="threads")
    p.add_argument("--no-bar", action="store_true")
    return p


def run(args) -> dict:
    """Run `main` on the ranks the mode needs (or on this world's, inside one)."""
    sf.init()
    if sf.world_size() > 1:
        return main(args)
    world = ranks_needed(args.mode, args.stages, rules.timeline_of(args.rule))
    return sf.launch(main, world_size=world, backend=args.backend, args=(args,))[0]


if __name__ == "__main__":
    run(arguments().parse_args())
