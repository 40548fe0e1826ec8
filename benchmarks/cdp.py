"""Cyclic Data Parallelism (issue 16): memory, communication and pipeline figures, each beside
its PyTorch equivalent in the same run.

1. activations (mode single, one rank): peak live (micro-batch x stage) activations of the
   executed schedule and measured bytes saved for backward, DP vs CDP v1 / v2, and step time
   taking turns, against torch running the N micro-batches as one batch and one by one;
2. dp (mode dp, N gloo processes): messages, bytes and the most gradient chunks made in one
   time step, and step time, against torch DDP (one bucketed all-reduce a step);
3. pp (mode pp, N gloo processes): step time and bubble fraction against
   ``torch.distributed.pipelining.Schedule1F1B`` on the same stages, weights and batch;
4. zero (mode zero, N gloo processes): messages, bytes and the most parameter bytes a rank
   held, and step time, against mode dp and torch FSDP2 (``fully_shard`` on each stage).

The model: N stages of Linear(width, width) + ReLU (balanced), cross-entropy over ``width``
classes, SGD with momentum 0.9, N micro-batches of ``--micro-batch`` a step.

    python benchmarks/cdp.py [--width 256] [--micro-batch 32] [--steps 20] [-n 4]
                             [--parts activations dp pp zero]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import sbpflow as sf
from timing import take_turns

LR, MOMENTUM = 0.01, 0.9


def _stages(n: int, width: int) -> list:
    sf.manual_seed(0)
    return [sf.nn.Sequential(sf.nn.Linear(width, width), sf.nn.ReLU()) for _ in range(n)]


def _torch_twin(stages: list) -> torch.nn.Sequential:
    """The same stages as torch modules, with the same weights."""
    mods = []
    for s in stages:
        lin = s[0]
        t = torch.nn.Linear(lin.in_features, lin.out_features)
        with torch.no_grad():
            t.weight.copy_(lin.weight.full_tensor())
            t.bias.copy_(lin.bias.full_tensor())
        mods += [t, torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _data(n: int, mb: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n * mb, width, generator=g),
            torch.randint(0, width, (n * mb,), generator=g))


def _loss(out, y):
    return sf.nn.functional.cross_entropy(out, y)


def _sgd(params):
    return sf.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _trainer(args, rule: str, mode: str):
    return sf.parallel.CyclicDataParallel(_stages(args.n, args.width), _loss, _sgd, rule=rule,
                                          mode=mode)


# -- 1. activations --------------------------------------------------------------------------
def _turns(fns: list, steps: int) -> list[float]:
    """Median seconds a step of each function, taking turns step by step (A B C A B C ...)
    after two warm-up steps each: load drifting over seconds hits them alike."""
    for f in fns:
        f()
        f()
    times = [[] for _ in fns]
    for _ in range(steps):
        for k, f in enumerate(fns):
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def _activations_rank(args) -> list:
    x, y = _data(args.n, args.micro_batch, args.width)
    trainers = {rule: _trainer(args, rule, "single") for rule in ("dp", "v1", "v2")}
    model = _torch_twin(_stages(args.n, args.width))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    micro = _torch_twin(_stages(args.n, args.width))
    micro_opt = torch.optim.SGD(micro.parameters(), lr=LR, momentum=MOMENTUM)
    xs, ys = torch.tensor_split(x, args.n), torch.tensor_split(y, args.n)

    def torch_step():
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def micro_step():  # the same N micro-batches, one by one, gradients accumulated
        for xi, yi in zip(xs, ys):
            torch.nn.functional.cross_entropy(micro(xi), yi).backward()
        micro_opt.step()
        micro_opt.zero_grad()
    staged = _torch_twin(_stages(args.n, args.width))
    fns = [lambda t=t: t.step(x, y) for t in trainers.values()]
    fns += [torch_step, micro_step, _stage_by_stage(staged, xs, ys)]
    times = _turns(fns, args.steps)
    rows = []
    for (rule, t), per in zip(trainers.items(), times):
        t.flush()
        st = t.stats()
        rows.append((f"sbpflow {rule}", st["peak_live_activations"],
                     st["peak_activation_bytes"], per))
    with sf.memory.track() as mem:
        torch_step()
    rows.append(("torch, N micro-batches as one batch", None, mem.peak, times[-3]))
    with sf.memory.track() as mem:
        micro_step()
    rows.append(("torch, the N micro-batches one by one", None, mem.peak, times[-2]))
    rows.append(("torch, stage by stage (CDP's work)", None, None, times[-1]))
    return rows


def _stage_by_stage(model: torch.nn.Sequential, xs: list, ys: list):
    """A plain-torch step doing the work a `single` step does, without the runtime: each
    (micro-batch, stage) a forward on a detached input and one `torch.autograd.grad`, the
    stage gradients summed, then SGD. The bound of a schedule that runs stages one by one."""
    stages = [model[k:k + 2] for k in range(0, len(model), 2)]
    params = [list(s.parameters()) for s in stages]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    def step():
        for xi, yi in zip(xs, ys):
            ins, outs, h = [], [], xi
            for s in stages:
                ins.append(h.detach().requires_grad_())
                h = s(ins[-1])
                outs.append(h)
            grad = None
            for j in reversed(range(len(stages))):
                seed = torch.nn.functional.cross_entropy(outs[j], yi) / len(xs) if grad is None \
                    else outs[j]
                got = torch.autograd.grad(seed, [ins[j], *params[j]], grad)
                grad = got[0]
                for p, g in zip(params[j], got[1:]):
                    p.grad = g if p.grad is None else p.grad.add_(g)
        opt.step()
        opt.zero_grad()
    return step


def activations(args) -> None:
    n = args.n
    rows = sf.launch(_activations_rank, world_size=1, args=(args,))[0]
    dp_bytes = rows[0][2]
    t_torch = rows[-3][3]
    print(f"\n1. activations, mode single: N = {n}, micro-batch {args.micro_batch}, width "
          f"{args.width} (balanced stages); median of {args.steps} steps taking turns")
    print(f"{'':<38}{'peak live':>10}{'saved bytes':>13}{'/ DP':>7}{'ms/step':>9}"
          f"{'/ torch':>9}")
    for name, live, nbytes, per in rows:
        saved = ("-", "-") if nbytes is None else (f"{nbytes:,}", f"{nbytes / dp_bytes:.3f}")
        print(f"{name:<38}{'-' if live is None else live:>10}{saved[0]:>13}{saved[1]:>7}"
              f"{per * 1e3:>9.2f}{per / t_torch:>9.2f}")
    print(f"(peak live: (micro-batch, stage) units, the spec's count from each F's step to its "
          f"B's, of the executed schedule: DP N^2 = {n * n}, CDP N(N+1)/2 = "
          f"{n * (n + 1) // 2}; (N+1)/(2N) = {(n + 1) / (2 * n):.3f}; saved bytes: "
          f"sf.memory.track, tensors autograd saved, at the peak; / torch: over torch's step "
          f"on the whole batch)")


# -- 2. dp on gloo processes -----------------------------------------------------------------
def _dp_rank(args) -> list:
    x, y = _data(args.n, args.micro_batch, args.width)
    r = dist.get_rank()
    trainers = {rule: _trainer(args, rule, "dp") for rule in ("dp", "v2")}
    model = torch.nn.parallel.DistributedDataParallel(_torch_twin(_stages(args.n, args.width)))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    xr, yr = torch.tensor_split(x, args.n)[r], torch.tensor_split(y, args.n)[r]

    def ddp_step():
        torch.nn.functional.cross_entropy(model(xr), yr).backward()
        opt.step()
        opt.zero_grad()
    fns = [lambda t=t: t.step(x, y) for t in trainers.values()] + [ddp_step]
    times = take_turns(fns, args.steps)
    rows = []
    for (rule, t), ts in zip(trainers.items(), times):
        t.flush()
        st = t.stats()
        rows.append((f"sbpflow dp mode, rule {rule}", st["messages_per_step"],
                     st["bytes_per_step"], st["max_grad_chunks_per_step"],
                     statistics.median(ts)))
    params = sum(p.numel() * 4 for p in model.parameters())
    ring = 2 * (args.n - 1) * params  # every rank sends 2(N-1)/N of the gradients
    rows.append(("torch DDP (ring all-reduce)", None, ring, args.n, statistics.median(times[-1])))
    return rows


def dp(args) -> None:
    rows = sf.launch(_dp_rank, world_size=args.n, backend="torch", args=(args,))[0]
    print(f"\n2. mode dp on {args.n} gloo processes: per training step, all ranks; median of "
          f"{args.steps} steps taking turns")
    print(f"{'':<32}{'messages':>9}{'bytes':>12}{'max chunks/step':>17}{'ms/step':>9}")
    for name, msgs, nbytes, chunks, per in rows:
        print(f"{name:<32}{'-' if msgs is None else f'{msgs:g}':>9}{nbytes:>12,.0f}"
              f"{chunks:>17}{per * 1e3:>9.2f}")
    print("(sbpflow: point-to-point messages counted by the trainer: each stage's gradient "
          "chain N-1 hops, its new version N-1 hops back; DDP: gloo's ring all-reduce volume, "
          "2(N-1)/N of the gradients a rank; chunks: stage gradients made in one time step, "
          "read from the executed schedule; DDP's N ranks finish each stage at once)")


# -- 3. pp against torch.distributed.pipelining ------------------------------------------------
def _pp_torch(args, x, y):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    r, n = dist.get_rank(), dist.get_world_size()
    module = _torch_twin(_stages(args.n, args.width))[2 * r:2 * r + 2]
    stage = PipelineStage(module, r, n, torch.device("cpu"))
    sched = Schedule1F1B(stage, n, loss_fn=torch.nn.functional.cross_entropy)
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)

    def step():
        if r == 0:
            sched.step(x)
        elif r == n - 1:
            sched.step(target=y)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
    return step


def _pp_rank(args) -> list:
    import logging
    torch._logging.set_logs(all=logging.ERROR)
    x, y = _data(args.n, args.micro_batch, args.width)
    trainers = {rule: _trainer(args, rule, "pp") for rule in ("dp", "v1", "v2")}
    fns = [lambda t=t: t.step(x, y) for t in trainers.values()] + [_pp_torch(args, x, y)]
    times = take_turns(fns, args.steps)
    rows = []
    for (rule, t), ts in zip(trainers.items(), times):
        t.flush()
        st = t.stats()
        rows.append((f"sbpflow pp mode, rule {rule}", statistics.median(ts),
                     st["bubble_fraction"]))
    s = m = args.n
    rows.append(("torch Schedule1F1B, M = N", statistics.median(times[-1]),
                 (s - 1) / (m + s - 1)))
    return rows


def pp(args) -> None:
    rows = sf.launch(_pp_rank, world_size=args.n, backend="torch", args=(args,))[0]
    t_torch = rows[-1][1]
    print(f"\n3. mode pp on {args.n} gloo processes (a stage each), N = {args.n} micro-batches "
          f"of {args.micro_batch}; median of {args.steps} steps taking turns")
    print(f"{'':<30}{'ms/step':>9}{'/ torch':>9}{'bubble':>8}")
    for name, per, bubble in rows:
        print(f"{name:<30}{per * 1e3:>9.2f}{per / t_torch:>9.2f}{bubble:>8.3f}")
    print("(bubble: sbpflow, idle op slots of the ranks in the executed schedule over all "
          "steps, warm-up and final flush included (0 between them: the cycles overlap); torch, "
          "1F1B's (S-1)/(M+S-1) a step, its schedule drains every step)")


# -- 4. zero against mode dp and FSDP2 ---------------------------------------------------------
def _fsdp(args, x, y):
    from torch.distributed.fsdp import fully_shard
    r = dist.get_rank()
    model = _torch_twin(_stages(args.n, args.width))
    for k in range(0, len(model), 2):
        fully_shard(model[k])   # each stage's Linear: gathered for its forward and backward
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    xr, yr = torch.tensor_split(x, args.n)[r], torch.tensor_split(y, args.n)[r]

    def step():
        torch.nn.functional.cross_entropy(model(xr), yr).backward()
        opt.step()
        opt.zero_grad()
    return step


def _zero_rank(args) -> list:
    x, y = _data(args.n, args.micro_batch, args.width)
    runs = [("zero", "dp"), ("zero", "v2"), ("dp", "v2")]
    trainers = [_trainer(args, rule, mode) for mode, rule in runs]
    fns = [lambda t=t: t.step(x, y) for t in trainers] + [_fsdp(args, x, y)]
    times = take_turns(fns, args.steps)
    rows = []
    for (mode, rule), t, ts in zip(runs, trainers, times):
        t.flush()
        st = t.stats()
        rows.append((f"sbpflow {mode} mode, rule {rule}", st["messages_per_step"],
                     st["bytes_per_step"], st["peak_param_bytes"], statistics.median(ts)))
    params = sum(p.numel() * 4 for p in _torch_twin(_stages(args.n, args.width)).parameters())
    # all-gather before each stage's forward and backward, reduce-scatter of its gradients
    rows.append(("torch FSDP2 (fully_shard a stage)", None, 3 * (args.n - 1) * params, None,
                 statistics.median(times[-1])))
    return rows


def zero(args) -> None:
    rows = sf.launch(_zero_rank, world_size=args.n, backend="torch", args=(args,))[0]
    n = args.n
    print(f"\n4. mode zero on {n} gloo processes: per training step, all ranks; median of "
          f"{args.steps} steps taking turns")
    print(f"{'':<34}{'messages':>9}{'bytes':>12}{'param bytes':>13}{'ms/step':>9}")
    for name, msgs, nbytes, held, per in rows:
        print(f"{name:<34}{'-' if msgs is None else f'{msgs:g}':>9}{nbytes:>12,.0f}"
              f"{'-' if held is None else f'{held:,}':>13}{per * 1e3:>9.2f}")
    print(f"(zero: a stage's copy relayed to each other worker for F_j and again for B_j but "
          f"the last stage's, its gradient sum N-1 hops plus one to the owner: 3N(N-1) = "
          f"{3 * n * (n - 1)} messages; param bytes: the most parameter and momentum bytes a "
          f"rank held after a task; FSDP2: gloo's all-gather and reduce-scatter volume, "
          f"3(N-1) x the parameters, all ranks)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=4, help="N: stages, workers, micro-batches")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--parts", nargs="+", default=["activations", "dp", "pp", "zero"],
                    choices=["activations", "dp", "pp", "zero"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for part in args.parts:
        {"activations": activations, "dp": dp, "pp": pp, "zero": zero}[part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
