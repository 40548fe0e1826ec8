"""Shared by the training examples: arguments, launching, layouts by name, the training loop
with its progress bar and the summary it prints.

A script defines ``main(args)`` — the body every rank runs — and ends with
``common.run(main, args)``, which runs it:

* directly, when this process already is a rank of a multi-rank world (``torchrun``,
  ``sbpflow run -n 4 [--backend torch] script.py``: `sf.init` joined it);
* else on ``-n`` new ranks with ``sf.launch`` (``--backend threads``, the default: one thread a
  rank in this process; ``--backend torch``: gloo processes).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch

import sbpflow as sf
from sbpflow.models import LAYOUT_NAMES, Layout, layout

__all__ = ["parser", "run", "get_layout", "train", "accuracy", "TrainResult", "fmt_bytes",
           "on_rank0"]


def parser(description: str, *, layouts=LAYOUT_NAMES, layout_default: str = "dp",
           steps: int = 200, batch: int = 32, lr: float = 1e-3) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--layout", choices=list(layouts), default=layout_default,
                   help=f"how parameters and data are laid out over the ranks (default "
                        f"{layout_default}; see sbpflow.models.layout)")
    p.add_argument("-n", "--nproc", type=int, default=4,
                   help="ranks to launch (default 4; ignored inside a multi-rank world)")
    p.add_argument("--backend", choices=["threads", "torch"], default="threads",
                   help="threads (default): one thread a rank in this process; torch: gloo "
                        "processes")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps, at most (default {steps}, or no limit with --seconds)")
    p.add_argument("--seconds", type=float, default=None,
                   help="stop after this many seconds of training (whichever comes first)")
    p.set_defaults(default_steps=steps)
    p.add_argument("--batch", type=int, default=batch, help=f"global batch size (default {batch})")
    p.add_argument("--lr", type=float, default=lr, help=f"learning rate (default {lr:g})")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--no-bar", action="store_true", help="no progress bar")
    return p


def run(main, args):
    """Run ``main(args)`` on every rank (see the module docstring); returns rank 0's result."""
    sf.init()
    if sf.world_size() > 1:  # already a rank of a world: every rank runs the script
        if args.nproc != sf.world_size() and on_rank0():
            print(f"(running on the {sf.world_size()} ranks of this world; -n ignored)",
                  file=sys.stderr)
        return main(args)
    return sf.launch(main, world_size=args.nproc, backend=args.backend, args=(args,))[0]


def on_rank0() -> bool:
    return sf.rank() == 0


def get_layout(model: str, args) -> Layout:
    """The named layout ``args.layout`` of ``model`` on this world's ranks."""
    return layout(model, args.layout, sf.world_size())


def accuracy(logits: sf.GlobalTensor, labels: torch.Tensor, what: str,
             label: str = "accuracy") -> float:
    """The fraction of ``labels`` the class scores ``logits`` (classes last) get right,
    printed by rank 0 as ``<label> ... on <what>`` (a collective: every rank calls it)."""
    acc = (logits.full_tensor().argmax(-1) == labels).float().mean().item()
    if on_rank0():
        print(f"  {label} {acc:.3f} on {what}")
    return acc


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class TrainResult:
    """What `train` measured (the same on every rank, but ``comm_per_step`` is this rank's)."""

    losses: list = field(default_factory=list)   # (step, loss)
    times: list = field(default_factory=list)    # seconds since the start, after each step
    steps: int = 0
    seconds: float = 0.0
    throughput: float = 0.0                      # units / s, after the first (warm-up) step
    unit: str = "samples"
    comm_per_step: dict = field(default_factory=dict)  # kind -> (bytes sent, calls) per step

    def comm_line(self) -> str:
        if not self.comm_per_step:
            return "no communication"
        total = sum(b for b, _ in self.comm_per_step.values())
        parts = ", ".join(f"{k} {fmt_bytes(b)} ({c:g} calls)"
                          for k, (b, c) in sorted(self.comm_per_step.items()))
        return f"{fmt_bytes(total)} sent per step by rank {sf.rank()}: {parts}"


def _time_is_up(up: bool) -> bool:
    """Whether any rank's clock says stop (ranks must agree, or a collective would hang)."""
    world = sf.world_size()
    if world == 1:
        return up
    flag = torch.tensor([1.0 if up else 0.0])
    return bool(sf.comm.current().all_reduce(flag, tuple(range(world)), op="max").item() > 0)


def _progress_bar(total, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is in the dev extras
        print("(no progress bar: pip install tqdm)", file=sys.stderr)
        return None
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)


def train(model, opt, batch_fn, args, *, per_step: int, unit: str = "samples",
          desc: str = "train") -> TrainResult:
    """``args.steps`` steps (and/or until ``args.seconds``) of: ``loss = model(*batch_fn(step))``,
    backward, ``opt.step()``. Shows a progress bar on rank 0 (loss, ``unit``/s with
    ``per_step`` units a step) and prints a summary there. Returns a `TrainResult`."""
    res = TrainResult(unit=unit)
    max_steps = args.steps
    if max_steps is None:
        max_steps = args.default_steps if args.seconds is None else sys.maxsize
    bar = _progress_bar(None if max_steps == sys.maxsize else max_steps, desc) \
        if on_rank0() and not args.no_bar else None
    comm_sum: dict = {}
    t0 = time.perf_counter()
    t_warm = None
    step = 0
    while step < max_steps:
        before = sf.comm.stats()
        opt.zero_grad()
        loss = model(*batch_fn(step))
        loss.backward()
        opt.step()
        value = loss.item()
        now = time.perf_counter() - t0
        after = sf.comm.stats()
        if step == 0:
            t_warm = now  # the first step also chooses signatures: left out of the rates
        else:
            for kind, k in after.kinds.items():
                b = before[kind]
                s, c = comm_sum.get(kind, (0, 0))
                comm_sum[kind] = (s + k.sent - b.sent, c + k.calls - b.calls)
        res.losses.append((step, value))
        res.times.append(now)
        step += 1
        if step > 1:
            res.throughput = per_step * (step - 1) / (now - t_warm)
        if bar is not None:
            bar.set_postfix({"loss": f"{value:.4f}",
                             f"{unit}/s": f"{res.throughput:.0f}" if step > 1 else "-"},
                            refresh=False)
            bar.update(1)
        if args.seconds is not None and _time_is_up(now >= args.seconds):
            break
    if bar is not None:
        bar.close()
    res.steps, res.seconds = step, time.perf_counter() - t0
    measured = max(step - 1, 1)
    res.comm_per_step = {k: (s / measured, c / measured) for k, (s, c) in comm_sum.items()
                         if s or c}
    if on_rank0():
        first, last = res.losses[0][1], res.losses[-1][1]
        rate = f"{res.throughput:.0f} {unit}/s" if res.steps > 1 else f"no {unit}/s (1 step)"
        print(f"{desc}: {res.steps} steps in {res.seconds:.1f} s, loss {first:.4f} -> {last:.4f}, "
              f"{rate}")
        print(f"  communication: {res.comm_line()}")
    return res
