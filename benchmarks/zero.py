"""ZeRO stages 1-3 against PyTorch's own: a GPT training step on 4 gloo processes (-n).

* step time: sbpflow ``zero3`` (eager, and ``zero3-graph``: the step as an ``sf.nn.Graph``
  with ``config.enable_zero(3)``) vs FSDP2 (``fully_shard`` on each block and the root, its
  defaults: parameters resharded after forward), ``zero1`` / ``zero2`` (and plain ``dp``) vs
  ``DistributedDataParallel``; taking turns step by step (`timing.take_turns`), median;
* bytes each rank sent in one step, against the formula of the stage;
* memory per rank for each layout (dp, zero1, zero2, zero3, tp, 2d) from ``sf.memory_stats``
  (after backward, before the update: gradients held) and the peak of ``sf.memory.track()``
  over forward and backward, beside FSDP2's local bytes counted the same way (its sharded
  parameters', gradients' and AdamW state's local tensors, each storage once).

Every optimizer is AdamW with torch's fused kernel (sbpflow's default).

    python benchmarks/zero.py [--steps 10] [--d 256] [--layers 4] [--batch 8] [--seq 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist

import sbpflow as sf
from timing import take_turns
from sbpflow.models import gpt_class, layout

SF_LAYOUTS = {"dp": ("dp", 0), "zero1": ("dp", 1), "zero2": ("dp", 2), "zero3": ("dp", 3),
              "tp": ("tp", 0), "2d": ("2d", 0)}
TIMED = [("zero3", "FSDP2"), ("zero3-graph", "FSDP2"), ("zero1", "DDP"), ("zero2", "DDP"),
         ("dp", "DDP")]


class _ZeroGraph(sf.nn.Graph):
    """One training step of a data-parallel model as a graph with ZeRO-3."""

    def __init__(self, model, opt) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.enable_zero(3)

    def build(self, *args):
        loss = self.model(*args)
        loss.backward()
        return loss


def _sf_step(cfg, name: str):
    """The step function of sbpflow's ``name`` (`TIMED`)."""
    if name == "zero3-graph":
        model, opt, args = _sf_model(cfg, "dp")
        graph = _ZeroGraph(model, opt)
        return lambda: graph(*args)
    return _step(*_sf_model(cfg, name))


def _data(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _sf_model(cfg, name: str):
    """The sbpflow GPT in layout ``name`` (`SF_LAYOUTS`) with its AdamW and inputs."""
    base, stage = SF_LAYOUTS[name]
    lay = layout("gpt", base, dist.get_world_size())
    sf.manual_seed(0)
    model = gpt_class(sf.nn, sf.nn.functional)(cfg["vocab"], cfg["d"], cfg["heads"],
                                               cfg["layers"], cfg["seq"])
    sf.parallel.apply(model, lay.placement, lay.rules, zero=stage)
    opt = sf.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data(cfg)
    pl = lay.placement
    args = (sf.tensor(x, pl, lay.data_sbp), sf.arange(cfg["seq"], placement=pl,
                                                      sbp=(sf.B,) * pl.ndim),
            sf.tensor(y, pl, lay.data_sbp))
    return model, opt, args


def _torch_model(cfg, kind: str):
    """FSDP2 (``fully_shard`` per block, then the root) or DDP GPT, its AdamW, its inputs."""
    torch.manual_seed(0)
    model = gpt_class(torch.nn, torch.nn.functional)(cfg["vocab"], cfg["d"], cfg["heads"],
                                                     cfg["layers"], cfg["seq"])
    if kind == "FSDP2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = _data(cfg)
    r, n = dist.get_rank(), dist.get_world_size()
    b = cfg["batch"] // n
    return model, opt, (x[r * b:(r + 1) * b], torch.arange(cfg["seq"]), y[r * b:(r + 1) * b])


def _step(model, opt, args):
    def step():
        model(*args).backward()
        opt.step()
        opt.zero_grad()
    return step


def _torch_local(t) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _torch_stats(model, opt) -> dict:
    """FSDP2's / DDP's local bytes as `sf.memory_stats` counts them (each storage once)."""
    seen, out = set(), {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind, t):
        if t is None:
            return
        t = _torch_local(t)
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            return
        seen.add(s.data_ptr())
        out[kind] += s.nbytes()
    params = list(model.parameters())
    for p in params:
        add("params", p)
    for p in params:
        add("grads", p.grad)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                add("optimizer", v)
    out["total"] = sum(out.values())
    return out


def _memory_row(model, opt, args, is_sf: bool) -> dict:
    """Model states after a step's backward (the optimizer state exists from the step before)
    and the tracked peak of forward + backward."""
    _step(model, opt, args)()
    with sf.memory.track() as mem:
        model(*args).backward()
    stats = sf.memory_stats(model, opt) if is_sf else _torch_stats(model, opt)
    opt.step()
    opt.zero_grad()
    return dict(stats, peak=mem.peak, saved=mem.peak_by_kind["saved"],
                gathered=mem.peak_by_kind["gathered"])


def _bench(cfg, steps: int):
    import logging
    torch._logging.set_logs(all=logging.ERROR)
    times, moved, gathered = [], {}, {}
    for name, ref in TIMED:
        sf_step = _sf_step(cfg, name)
        sf_step()
        sf.parallel.zero.settle()   # zero1: the all-gather after the update runs in the background
        sf.comm.reset_stats()
        with sf.memory.track() as mem:
            sf_step()
        sf.parallel.zero.settle()
        moved[name] = sf.comm.stats().sent
        gathered[name] = mem.peak_by_kind["gathered"]
        t_sf, t_ref = (statistics.median(ts) for ts in
                       take_turns([sf_step, _step(*_torch_model(cfg, ref))], steps))
        times.append((name, ref, t_sf, t_ref))
    memory = {name: _memory_row(*_sf_model(cfg, name), True) for name in SF_LAYOUTS}
    for ref in ("DDP", "FSDP2"):
        memory[ref] = _memory_row(*_torch_model(cfg, ref), False)
    return dict(times=times, moved=moved, gathered=gathered, memory=memory)


def _param_count(cfg) -> int:
    d, v, L, s = cfg["d"], cfg["vocab"], cfg["layers"], cfg["seq"]
    return v * d + s * d + L * (12 * d * d + 13 * d) + 2 * d + d * v


def _formula(cfg, name: str, n: int) -> str:
    """Bytes a rank sends per step by the stage's formula (float32, all parameters)."""
    p = _param_count(cfg) * 4
    mult = {"dp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "zero3-graph": 3}[name]
    return f"{mult}|P|(N-1)/N = {mult * p * (n - 1) // n}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("-n", "--ranks", type=int, default=4)
    args = ap.parse_args(argv)
    cfg = dict(vocab=args.vocab, d=args.d, heads=args.heads, layers=args.layers,
               batch=args.batch, seq=args.seq)
    n = args.ranks
    print(f"GPT d={args.d} layers={args.layers} heads={args.heads} batch={args.batch} "
          f"seq={args.seq} vocab={args.vocab} ({_param_count(cfg)} parameters); {n} gloo "
          f"processes; median of {args.steps} steps, sbpflow and torch taking turns")
    res = sf.launch(_bench, world_size=n, backend="torch", args=(cfg, args.steps))
    r0 = res[0]
    print(f"\n{'layout':<12}{'vs':<7}{'sbpflow ms':>11}{'torch ms':>10}{'ratio':>7}"
          f"{'sent/rank':>12}{'gathered':>10}  formula")
    for name, ref, t_sf, t_ref in r0["times"]:
        print(f"{name:<12}{ref:<7}{t_sf * 1e3:>11.1f}{t_ref * 1e3:>10.1f}{t_sf / t_ref:>7.2f}"
              f"{r0['moved'][name]:>12}{r0['gathered'][name]:>10}  {_formula(cfg, name, n)}")
    print("(gathered: the peak bytes of gathered weights in one step, sf.memory.track)")
    print("\nmemory per rank (bytes; rank 0; params / grads / optimizer after backward, peak: "
          "sf.memory.track over forward + backward)")
    print(f"{'layout':<8}{'params':>11}{'grads':>11}{'optimizer':>11}{'states':>11}"
          f"{'vs dp':>7}{'peak':>11}{'saved':>11}{'gathered':>11}")
    dp = r0["memory"]["dp"]["total"]
    for name, m in r0["memory"].items():
        print(f"{name:<8}{m['params']:>11}{m['grads']:>11}{m['optimizer']:>11}{m['total']:>11}"
              f"{m['total'] / dp:>7.3f}{m['peak']:>11}{m['saved']:>11}{m['gathered']:>11}")
    print("(torch rows: the peak counts the tensors autograd saves; FSDP2's all-gathered "
          "parameters are not seen by the hooks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
