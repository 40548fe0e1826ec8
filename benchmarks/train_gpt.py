"""GPT training step: sbpflow vs PyTorch's own equivalents, side by side on 4 gloo processes (-n).

* data parallel: sbpflow (parameters B, tokens S(0)) vs ``DistributedDataParallel``, whose
  ``torch.optim.AdamW`` runs torch's default kernel (one parameter at a time on a CPU) and, in
  the "DDP fused" row, the fused kernel sbpflow's AdamW uses by default (the same update: that
  row shows what the framework itself costs); "dp graph": the same step as an ``sf.nn.Graph``
  ("dp/sum graph": with the loss written as the "dp/sum" row's, no count all-reduce);
* tensor parallel: sbpflow (Megatron column -> row layouts) vs DTensor ``parallelize_module``;
* "dp torch": the same GPT written in plain torch, converted by ``sf.nn.from_torch`` and laid out
  by ``sf.parallel.apply``, against the sf.nn GPT's data-parallel step (the "torch" column);
* "bound": DDP's kernels alone (its model, batch and fused AdamW in plain torch, no
  communication), and those plus one gradient all-reduce after the backward, against DDP
  fused: no data-parallel step on these processes can beat the first; "bound: cpu": the CPU
  time of the second (every thread: compute and gloo's), summed over the processes, over the
  cores they share, against DDP fused's wall time: no schedule of that work on these cores
  finishes sooner, however it overlaps ("DDP fused cpu": the same for DDP fused itself);
* per-op overhead on small tensors (each minus the local torch kernel's time): sbpflow eager
  ``x + x`` / ``x @ w`` / ``relu`` vs DTensor's, and sbpflow graph mode vs eager.

Prints median step times (ms), the ratio, and the bytes sbpflow moved per step against the
minimum its layouts imply.  ``--graph``: the graph rows and tables only.

    python benchmarks/train_gpt.py [--steps 10] [--d 128] [--layers 2] [--batch 8] [--seq 64]
    python benchmarks/train_gpt.py --phases [-n 2]   # where a dp step's time goes (graph too)
    python benchmarks/train_gpt.py --graph --first-bucket 1024   # DDP's first bucket, in a graph
    python benchmarks/train_gpt.py --graph --threads   # the graph's actors on the runtime's
                                  # queue threads vs inline (gloo runs on threads either way:
                                  # its collectives cannot be interrupted; docs/runtime.md)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import sbpflow as sf
from timing import take_turns
from sbpflow.models import gpt_class

TP_RULES = {"*.attn.qkv.*": sf.S(0), "*.attn.proj.weight": sf.S(1), "*.mlp.fc.*": sf.S(0),
            "*.mlp.proj.weight": sf.S(1), "*": sf.B}


def _timed(steps_to_time: list, steps: int) -> list[float]:
    """Median seconds per step of each step function (`timing.take_turns`)."""
    return [statistics.median(ts) for ts in take_turns(steps_to_time, steps)]


def _data(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _as_step(forward, opt):
    """A training step from its parts: ``forward()`` gives the loss; backward; the update."""
    def step():
        forward().backward()
        opt.step()
        opt.zero_grad()
    step.parts = (forward, opt)
    return step


def _sf_step(cfg, layout: str):
    """One training step of the sbpflow GPT. ``layout``: "dp", "tp", or "dp/sum": data
    parallel with the loss written as ``cross_entropy(..., reduction="sum") / tokens``, the
    same value as the mean when no target is ``ignore_index`` (true here) but without the
    all-reduce of the valid-target count the exact mean needs (DDP's per-rank mean skips it
    too: it is exact only when every rank has as many valid targets). Returns (step, model)."""
    pl = sf.placement("cpu", list(range(dist.get_world_size())))
    GPT = gpt_class(sf.nn, sf.nn.functional)
    sf.manual_seed(0)
    model = GPT(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], cfg["seq"])
    rules = TP_RULES if layout == "tp" else {"*": sf.B}
    sf.parallel.apply(model, pl, rules)
    opt = sf.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data(cfg)
    data_sbp = sf.S(0) if layout.startswith("dp") else sf.B
    xs, ys = sf.tensor(x, pl, data_sbp), sf.tensor(y, pl, data_sbp)
    pos = sf.arange(cfg["seq"], placement=pl, sbp=sf.B)
    tokens = float(y.numel())

    def forward():
        if layout == "dp/sum":
            logits = model(xs, pos)
            return sf.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab"]),
                                                  ys.reshape(-1), reduction="sum") / tokens
        return model(xs, pos, ys)
    return _as_step(forward, opt), model


def _converted_step(cfg):
    """The data-parallel step of `_sf_step` on the GPT written in plain torch (the sf.nn GPT's
    torch twin), converted by ``sf.nn.from_torch`` and laid out by ``sf.parallel.apply``: its
    own forward runs, its torch calls dispatched to sbpflow ops. Returns (step, model)."""
    pl = sf.placement("cpu", list(range(dist.get_world_size())))
    model = sf.parallel.apply(sf.nn.from_torch(_torch_model(cfg), pl), pl, {"*": sf.B})
    opt = sf.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data(cfg)
    xs, ys = sf.tensor(x, pl, sf.S(0)), sf.tensor(y, pl, sf.S(0))
    pos = sf.arange(cfg["seq"], placement=pl, sbp=sf.B)
    return _as_step(lambda: model(xs, pos, ys), opt), model


def _graph_step(cfg, micro_batches: int = 1, loss: str = "mean",
                first_bucket: int | None = None):
    """The data-parallel step of `_sf_step` as an ``sf.nn.Graph`` (traced once, replayed by the
    actor runtime: forward, backward with the overlapped gradient all-reduce, fused AdamW).
    ``loss="sum"``: the loss as in `_sf_step`'s "dp/sum" (no all-reduce of the valid-target
    count in the forward, as DDP's per-rank mean). ``first_bucket``: the first gradient
    bucket's bytes (``Optimizer.first_grad_bucket_bytes``; None: the default, on a CPU the
    whole gradient in one bucket). Returns (step, graph)."""
    pl = sf.placement("cpu", list(range(dist.get_world_size())))
    sf.manual_seed(0)
    model = gpt_class(sf.nn, sf.nn.functional)(cfg["vocab"], cfg["d"], cfg["heads"],
                                               cfg["layers"], cfg["seq"])
    sf.parallel.apply(model, pl, {"*": sf.B})
    opt = sf.optim.AdamW(model.parameters(), lr=1e-3)
    opt.first_grad_bucket_bytes = first_bucket

    class TrainStep(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(micro_batches)

        def build(self, x, pos, y):
            if loss == "sum":
                logits = self.model(x, pos)
                out = sf.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab"]),
                                                     y.reshape(-1), reduction="sum") / tokens
            else:
                out = self.model(x, pos, y)
            out.backward()
            return out
    tokens = float(cfg["batch"] * cfg["seq"])
    graph = TrainStep()
    x, y = _data(cfg)
    xs, ys = sf.tensor(x, pl, sf.S(0)), sf.tensor(y, pl, sf.S(0))
    pos = sf.arange(cfg["seq"], placement=pl, sbp=sf.B)
    return (lambda: graph(xs, pos, ys)), graph


def _on_threads(step, graph):
    """``step`` compiled, its runtime made to run the actors on its queue threads instead of
    the calling thread (sbpflow internals: the runtime's ``inline`` flag, kept while its plan
    is the same): the hand-offs a call cost before a data-parallel rank ran inline."""
    step()
    graph._last.runtime.inline = False
    return step


def _torch_model(cfg):
    TorchGPT = gpt_class(torch.nn, torch.nn.functional)
    torch.manual_seed(0)
    return TorchGPT(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], cfg["seq"])


def _ddp_step(cfg, fused: bool | None = None):
    """DDP with ``torch.optim.AdamW``: torch's default kernel (one parameter at a time on a
    CPU), or ``fused=True``: the fused kernel sbpflow's AdamW uses by default."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_torch_model(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    x, y = _data(cfg)
    r, n = dist.get_rank(), dist.get_world_size()
    b = cfg["batch"] // n
    xl, yl = x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]
    pos = torch.arange(cfg["seq"])
    return _as_step(lambda: model(xl, pos, yl), opt)


def _kernels_step(cfg, all_reduce: bool = False):
    """The bound of a data-parallel step on these processes: DDP's model, batch and fused
    AdamW in plain torch with no DDP (its kernels alone: no communication, no hooks);
    ``all_reduce``: plus one all-reduce of all gradients, flattened, after the backward
    (the communication, not overlapped). Timed beside DDP fused on the same processes."""
    model = _torch_model(cfg)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    x, y = _data(cfg)
    r, n = dist.get_rank(), dist.get_world_size()
    b = cfg["batch"] // n
    xl, yl = x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]
    pos = torch.arange(cfg["seq"])

    def step():
        model(xl, pos, yl).backward()
        if all_reduce:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= n
            at = 0
            for p in params:
                p.grad.copy_(flat[at:at + p.numel()].view_as(p.grad))
                at += p.numel()
        opt.step()
        opt.zero_grad()
    return step


def _cpu_bound(step, steps: int) -> float:
    """Seconds per step the machine needs at least for ``step``'s CPU work: each process's
    CPU time in all its threads (compute, gloo's), summed over the processes, over the cores
    they can run on. A gloo wait blocks (it does not spin), so waiting is not counted."""
    step()
    step()
    dist.barrier()
    t = time.process_time()
    for _ in range(steps):
        step()
    cpu = torch.tensor([(time.process_time() - t) / steps], dtype=torch.float64)
    dist.all_reduce(cpu)
    return float(cpu) / len(os.sched_getaffinity(0))


def _dtensor_tp_step(cfg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _torch_model(cfg)
    plan = {}
    for i in range(cfg["layers"]):
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(),
                     f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(),
                     f"blocks.{i}.mlp.proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x, y = _data(cfg)
    pos = torch.arange(cfg["seq"])

    def step():
        loss = model(x, pos, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def _op_overhead(iters: int = 500, repeats: int = 7) -> dict:
    """Per op: (sbpflow, DTensor, local torch kernel) seconds per call on small tensors.

    Each rank runs the calls on its own (no collective is involved: the layouts need no
    boxing). The three are interleaved and each takes its best of ``repeats`` runs, so load from
    the other ranks (4 processes on a 2-core machine) hits all three alike. The *overhead* of a
    framework is its time minus the kernel's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    pl = sf.placement("cpu", list(range(dist.get_world_size())))
    out = {}
    xs = sf.randn(16, 8, placement=pl, sbp=sf.S(0), seed=0)
    ws = sf.randn(8, 8, placement=pl, sbp=sf.B, seed=1)
    xl, wl = xs.local, ws.local
    xd = DTensor.from_local(xl, mesh, [Shard(0)], run_check=False)
    wd = DTensor.from_local(wl, mesh, [Replicate()], run_check=False)
    for name, fns in [("add", (lambda: xs + xs, lambda: xd + xd, lambda: xl + xl)),
                      ("matmul", (lambda: xs @ ws, lambda: xd @ wd, lambda: xl @ wl)),
                      ("relu", (lambda: xs.relu(), lambda: xd.relu(), lambda: xl.relu()))]:
        best = [float("inf")] * 3
        for f in fns:
            for _ in range(50):
                f()
        for _ in range(repeats):
            for i, f in enumerate(fns):
                t = time.perf_counter()
                for _ in range(iters):
                    f()
                best[i] = min(best[i], (time.perf_counter() - t) / iters)
        out[name] = tuple(best)
    return out


def _op_graph(op, n: int):
    """A forward-only graph whose build applies ``op`` ``n`` times."""
    class Ops(sf.nn.Graph):
        def build(self, x, w):
            for _ in range(n):
                x = op(x, w)
            return x
    return Ops()


def _graph_op_overhead(n: int = 2000, repeats: int = 7, warm: int = 200) -> dict:
    """Per op: (graph, eager, kernel) seconds per op on small tensors, and the graph's fixed
    cost per call. A graph whose build does ``n`` ops against one that does 1: the difference
    over ``n - 1`` ops is the replayed op's time, the one-op graph's time less one kernel the
    cost of a call (the runtime's start, firing, the inputs and outputs), each timed as one
    call after a barrier (every rank starts at once: on fewer cores than ranks it waits for
    one, and its caches are cold). "warm": the one-op graph called ``warm`` times in a row,
    the mean call less one kernel (the figure of a training loop's back-to-back calls).
    Eager: ``n`` ops in a loop; kernel: the same loop on the local tensors. Interleaved, best
    of ``repeats``, each rank on its own (the layouts need no boxing; the graph's runtime only
    posts its start to the other ranks)."""
    pl = sf.placement("cpu", list(range(dist.get_world_size())))
    xs = sf.randn(16, 8, placement=pl, sbp=sf.S(0), seed=0)
    ws = sf.tensor(torch.eye(8), pl, sf.B)  # x @ w keeps x's values (no overflow in the chain)
    xl, wl = xs.local, ws.local
    out = {}
    for name, op in [("add", lambda x, w: x + x), ("matmul", lambda x, w: x @ w),
                     ("relu", lambda x, w: x.relu())]:
        big, one = _op_graph(op, n), _op_graph(op, 1)

        def eager(x=xs, op=op):
            for _ in range(n):
                x = op(x, ws)

        def kernel(x=xl, op=op):
            for _ in range(n):
                x = op(x, wl)
        def warm_calls(one=one):
            for _ in range(warm):
                one(xs, ws)
        fns = [lambda: big(xs, ws), lambda: one(xs, ws), eager, kernel, warm_calls]
        best = [float("inf")] * len(fns)
        for f in fns:  # the graphs compile on their first call
            for _ in range(3):
                f()
        for _ in range(repeats):
            for i, f in enumerate(fns):
                dist.barrier()
                t = time.perf_counter()
                f()
                best[i] = min(best[i], time.perf_counter() - t)
        k = best[3] / n
        out[name] = ((best[0] - best[1]) / (n - 1), best[2] / n, k, best[1] - k,
                     best[4] / warm - k)
    return out


def _mlp_steps(layers: int = 64, width: int = 32, batch: int = 32):
    """A dispatch-bound model's data-parallel training step, eager and as an ``sf.nn.Graph``
    (the same model, data and SGD update; the graph replays the traced step): ``layers``
    Linear(width, width) + ReLU, a batch of ``batch`` rows split over the ranks, the MSE
    loss. Returns (eager step, graph step). (Either backend: threads or gloo processes.)"""
    pl = sf.placement("cpu", list(range(sf.world_size())))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    xs, ys = sf.tensor(x, pl, sf.S(0)), sf.tensor(y, pl, sf.S(0))

    def model_opt():
        sf.manual_seed(0)
        layers_ = [m for _ in range(layers) for m in (sf.nn.Linear(width, width), sf.nn.ReLU())]
        model = sf.parallel.apply(sf.nn.Sequential(*layers_), pl, {"*": sf.B})
        return model, sf.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = model_opt()
    eager = _as_step(lambda: sf.nn.functional.mse_loss(model(xs), ys), opt)
    gmodel, gopt = model_opt()

    class MLPStep(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = gmodel
            self.add_optimizer(gopt)

        def build(self, x, y):
            loss = sf.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            return loss
    graph = MLPStep()
    return eager, lambda: graph(xs, ys)


def _mlp_torch(layers: int = 64, width: int = 32, batch: int = 32, all_reduce: bool = False):
    """`_mlp_steps`'s model in plain torch on this rank's rows alone (no gradient all-reduce):
    the step's kernels and torch's own dispatch, a bound no framework over torch goes under.
    ``all_reduce``: with one all-reduce of all the gradients (flattened) after the backward
    (gloo processes: the communication a data-parallel step cannot avoid)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers)
                                  for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    rows = batch // sf.world_size()
    x, y = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    if not all_reduce:
        return _as_step(lambda: torch.nn.functional.mse_loss(model(x), y), opt)
    params = list(model.parameters())

    def step():
        torch.nn.functional.mse_loss(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        torch._foreach_copy_([p.grad for p in params],
                             [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]),
                                                            params)])
        opt.step()
        opt.zero_grad()
    return step


def _mlp_on_threads(steps: int):
    """`_mlp_steps` on rank threads (one intra-op thread: rank threads share the cores), eager
    and graph taking turns. Returns (graph, eager, plain torch) medians (s)."""
    torch.set_num_threads(1)
    eager, graph = _mlp_steps()
    plain = _mlp_torch()
    for f in (eager, graph, plain, eager, graph, plain):
        f()
    comm, ranks = sf.comm.current(), tuple(range(sf.world_size()))
    times: list = [[], [], []]
    for _ in range(steps):
        for k, f in enumerate((graph, eager, plain)):
            comm.barrier(ranks)
            t = time.perf_counter()
            f()
            comm.barrier(ranks)
            times[k].append(time.perf_counter() - t)
    return tuple(statistics.median(t) for t in times)


def _ops_only(steps: int):
    """The per-op table in graph mode and the dispatch-bound MLP step, eager vs graph."""
    eager, graph = _mlp_steps()
    t_graph, t_eager, t_torch, t_ar = _timed([graph, eager, _mlp_torch(),
                                              _mlp_torch(all_reduce=True)], steps)
    graph_ops = _graph_op_overhead()
    rows = [("mlp64 graph", "mlp64 eager", t_graph, t_eager, 0, {}),
            ("mlp64 torch", "mlp64 eager", t_torch, t_eager, 0, {}),
            ("mlp64 torch+ar", "mlp64 eager", t_ar, t_eager, 0, {})]
    return (rows, {}, graph_ops) if dist.get_rank() == 0 else None


def _bench(cfg, steps, graph_only: bool = False, first_bucket: int | None = None,
           threads: bool = False):
    import logging
    torch._logging.set_logs(all=logging.ERROR)
    rows = []
    fused = lambda c: _ddp_step(c, fused=True)  # noqa: E731
    sf_nn_dp = lambda c: _sf_step(c, "dp")[0]  # noqa: E731
    cases = [("dp", "DDP", _ddp_step), ("dp", "DDP fused", fused), ("dp/sum", "DDP", _ddp_step),
             ("tp", "DTensor TP", _dtensor_tp_step), ("dp graph", "DDP", _ddp_step),
             ("dp graph", "DDP fused", fused), ("dp/sum graph", "DDP fused", fused),
             ("dp torch", "sf.nn dp", sf_nn_dp),
             ("bound: kernels", "DDP fused", fused), ("bound: +allreduce", "DDP fused", fused),
             ("bound: cpu", "DDP fused", fused), ("DDP fused cpu", "DDP fused", fused)]
    if first_bucket is not None:   # against the default graph, taking turns with it
        cases.insert(6, ("dp graph/1st", "dp graph", lambda c: _graph_step(c)[0]))
    if threads:   # against the default (inline) graph, taking turns with it
        cases.insert(6, ("dp graph/thr", "dp graph", lambda c: _graph_step(c)[0]))
    for layout, ref_name, ref in cases:
        if graph_only and "graph" not in layout and not layout.startswith(("bound", "DDP")):
            continue
        if layout.endswith("cpu"):   # a CPU-time bound against the reference's wall time
            cpu_of = ref(cfg) if layout.startswith("DDP") else _kernels_step(cfg, True)
            t_ref = _timed([ref(cfg)], steps)[0]
            rows.append((layout, ref_name, _cpu_bound(cpu_of, steps), t_ref, 0, {}))
            continue
        if layout.startswith("bound"):  # torch alone: sbpflow moves nothing
            t_sf, t_ref = _timed([_kernels_step(cfg, "allreduce" in layout), ref(cfg)], steps)
            rows.append((layout, ref_name, t_sf, t_ref, 0, {}))
            continue
        sf_step = _graph_step(cfg)[0] if layout == "dp graph" else \
            _graph_step(cfg, first_bucket=first_bucket)[0] if layout == "dp graph/1st" else \
            _graph_step(cfg, loss="sum")[0] if layout == "dp/sum graph" else \
            _on_threads(*_graph_step(cfg)) if layout == "dp graph/thr" else \
            _converted_step(cfg)[0] if layout == "dp torch" else _sf_step(cfg, layout)[0]
        sf_step()
        sf.comm.reset_stats()
        sf_step()
        st = sf.comm.stats()
        moved = torch.tensor([st.sent])
        dist.all_reduce(moved)
        t_sf, t_ref = _timed([sf_step, ref(cfg)], steps)
        rows.append((layout, ref_name, t_sf, t_ref, int(moved), dict(
            (k, v.sent) for k, v in st.kinds.items())))
    ops = {} if graph_only else _op_overhead()
    graph_ops = _graph_op_overhead()
    return (rows, ops, graph_ops) if dist.get_rank() == 0 else None


def _eager_phases(step):
    """One eager step cut at its phases: [(thread CPU, wall)] at the start and after forward,
    backward, the optimizer step."""
    forward, opt = step.parts
    marks = [(time.thread_time(), time.perf_counter())]
    loss = forward()
    marks.append((time.thread_time(), time.perf_counter()))
    loss.backward()
    marks.append((time.thread_time(), time.perf_counter()))
    opt.step()
    opt.zero_grad()
    marks.append((time.thread_time(), time.perf_counter()))
    return marks


def _graph_phases(step, graph):
    """A graph step's phases, as `_eager_phases`: each is the (thread CPU, wall) time inside the
    forward, backward and update actors (on the calling thread: a data-parallel rank runs
    its actors inline; on the runtime's compute thread after `_on_threads`); the wall
    time of the call around them is the ``rest`` of the step. Wraps the actors' functions of
    the compiled plan (sbpflow internals: ``graph._last.plan``)."""
    got: dict = {}
    for spec in graph._last.plan.actors[dist.get_rank()]:
        if spec.kind in ("forward", "backward", "update") and not hasattr(spec.fn, "timed"):
            def timed(*args, fn=spec.fn, kind=spec.kind):
                c, t = time.thread_time(), time.perf_counter()
                try:
                    return fn(*args)
                finally:
                    cpu, wall = got.get(kind, (0.0, 0.0))
                    got[kind] = (cpu + time.thread_time() - c, wall + time.perf_counter() - t)
            timed.timed = True
            spec.fn = timed

    def run():
        got.clear()
        step()
        marks, cpu, wall = [(0.0, 0.0)], 0.0, 0.0
        for kind in ("forward", "backward", "update"):
            c, w = got.get(kind, (0.0, 0.0))
            cpu, wall = cpu + c, wall + w
            marks.append((cpu, wall))
        return marks
    return run


def _phases(cfg, steps, threads: bool = False):
    """Per rank, the median CPU time (of the thread running it) and wall time of each phase of
    a data parallel step — forward, backward, optimizer step, and the rest of the call — and
    the step's CPU time summed over all the process's threads (the backend's and the runtime's
    too), for sbpflow eager and graph mode and DDP (both AdamW kernels), taking turns step by
    step. With more ranks than cores, the step's wall time follows that process CPU."""
    graph_step, graph = _graph_step(cfg)
    graph_step()  # compiles
    runs = {"sbpflow dp": (lambda s: lambda: _eager_phases(s))(_sf_step(cfg, "dp")[0]),
            "sf graph": _graph_phases(graph_step, graph),
            "DDP": (lambda s: lambda: _eager_phases(s))(_ddp_step(cfg)),
            "DDP fused": (lambda s: lambda: _eager_phases(s))(_ddp_step(cfg, fused=True))}
    if threads:  # the graph with its actors on the runtime's queue threads
        thr_step, thr_graph = _graph_step(cfg)
        runs["graph/thr"] = _graph_phases(_on_threads(thr_step, thr_graph), thr_graph)
    times = {name: [[] for _ in range(8)] for name in runs}
    for i in range(steps + 3):
        for name, run in runs.items():
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            marks = run()
            total, cpu = time.perf_counter() - t, time.process_time() - c
            if i >= 3:  # warm-up steps set up buckets and caches
                for k in range(3):
                    times[name][2 * k].append(marks[k + 1][0] - marks[k][0])
                    times[name][2 * k + 1].append(marks[k + 1][1] - marks[k][1])
                times[name][6].append(total - (marks[3][1] - marks[0][1]))
                times[name][7].append(cpu)
    return {name: [statistics.median(v) for v in vs] for name, vs in times.items()}


def _min_bytes(cfg, layout: str, n: int = 4) -> int:
    """Bytes (summed over ranks) the layouts imply per step (float32)."""
    d, v, L, s, b = cfg["d"], cfg["vocab"], cfg["layers"], cfg["seq"], cfg["batch"]
    params = v * d + s * d + L * (12 * d * d + 13 * d) + 2 * d + d * v
    if layout in ("dp/sum", "dp/sum graph"):  # one all-reduce of every gradient
        return 2 * (n - 1) * params * 4
    if layout in ("dp", "dp graph", "dp graph/1st", "dp graph/thr", "dp torch"):
        # one all-reduce of every gradient, and of the loss's count of valid (not ignore_index)
        # targets: a float32 scalar, so the mean is over the whole batch, as on one device
        return 2 * (n - 1) * params * 4 + 2 * (n - 1) * 4
    act = b * s * d * 4
    # per layer: forward all-reduce after each row-parallel linear (2), backward all-reduce of
    # the input gradient of each column-parallel linear (2); plus the replicated parameters'
    # partial gradients all-reduced by the optimizer
    replicated = params - L * (12 * d * d + 9 * d)
    return 4 * L * 2 * (n - 1) * act + 2 * (n - 1) * replicated * 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("-n", "--ranks", type=int, default=4,
                    help="gloo processes (default 4; batch and heads must divide by it)")
    ap.add_argument("--phases", action="store_true",
                    help="instead: CPU and wall time of each phase of a data-parallel step")
    ap.add_argument("--graph", action="store_true",
                    help="only the graph-mode rows and the graph's per-op overhead")
    ap.add_argument("--ops", action="store_true",
                    help="only the per-op table in graph mode and a dispatch-bound model's "
                         "step (an MLP of 64 layers of width 32, data parallel), eager vs "
                         "graph")
    ap.add_argument("--threads", action="store_true",
                    help="add the graph with its actors on the runtime's queue threads (a "
                         "'dp graph/thr' row against the default graph; with --phases a "
                         "'graph/thr' row; on gloo the default runs on threads too, "
                         "so the rows match: only the threads backend runs inline)")
    ap.add_argument("--first-bucket", type=int, default=None, metavar="KIB",
                    help="add a 'dp graph/1st' row: the graph with a first gradient bucket of "
                         "KIB KiB (DDP's is 1024) against the default graph (on a CPU: one "
                         "bucket), taking turns")
    args = ap.parse_args(argv)
    if args.ranks < 1 or args.batch % args.ranks or args.heads % args.ranks:
        ap.error(f"-n {args.ranks}: the batch ({args.batch}) and the heads ({args.heads}) must "
                 "divide by the number of ranks (data and tensor parallelism split them)")
    cfg = dict(vocab=args.vocab, d=args.d, heads=args.heads, layers=args.layers,
               batch=args.batch, seq=args.seq)
    print(f"GPT d={args.d} layers={args.layers} heads={args.heads} batch={args.batch} "
          f"seq={args.seq} vocab={args.vocab}; {args.ranks} gloo processes; median of "
          f"{args.steps} steps, sbpflow and torch taking turns")
    if args.phases:
        per_rank = sf.launch(_phases, world_size=args.ranks, backend="torch",
                             args=(cfg, args.steps, args.threads))
        print(f"{'rank':<5}{'':<12}{'forward cpu / wall':>20}{'backward cpu / wall':>21}"
              f"{'step cpu / wall':>18}{'rest wall':>11}{'proc cpu':>10}   (ms)")
        for r, phases in enumerate(per_rank):
            for name, v in phases.items():
                print(f"{r:<5}{name:<12}" + "".join(
                    f"{v[2 * k] * 1e3:>{12 if k else 13}.2f} / {v[2 * k + 1] * 1e3:<5.2f}"
                    for k in range(3)) + f"{v[6] * 1e3:>9.2f}{v[7] * 1e3:>10.2f}")
        print("sf graph: the phases are the forward, backward and update actors (on the "
              "calling thread; graph/thr: on the runtime's compute thread);\nrest: the call's "
              "wall time outside them (split inputs, the runtime's start, firing, threads, "
              "the outputs);\nproc cpu: the "
              "step's CPU time in all the process's threads (compute, gloo's, the runtime's)")
        return 0
    if args.ops:
        rows, ops, graph_ops = sf.launch(_ops_only, world_size=args.ranks, backend="torch",
                                         args=(args.steps,))[0]
        t_graph, t_eager, t_torch = sf.launch(_mlp_on_threads, world_size=args.ranks,
                                              backend="threads", args=(args.steps,))[0]
        rows += [("mlp64 gr/thr", "eager/thr", t_graph, t_eager, 0, {}),
                 ("mlp64 to/thr", "eager/thr", t_torch, t_eager, 0, {})]
        _print_bench(rows, ops, graph_ops, cfg, args.ranks)
        print("mlp64: Linear(32, 32) + ReLU x 64, data parallel, SGD, batch 32; on gloo "
              "processes, and (/thr) on rank threads; torch: the same step in plain torch on "
              "a rank's rows, no all-reduce (the kernels' bound); torch+ar: that and one "
              "all-reduce of the flattened gradients")
        return 0
    _print_bench(*sf.launch(_bench, world_size=args.ranks, backend="torch",
                            args=(cfg, args.steps, args.graph,
                                  None if args.first_bucket is None else args.first_bucket << 10,
                                  args.threads)
                            )[0], cfg, args.ranks)
    return 0


def _print_bench(rows: list, ops: dict, graph_ops: dict, cfg: dict, ranks: int) -> None:
    print(f"{'layout':<18}{'vs':<12}{'sbpflow ms':>11}{'torch ms':>10}{'ratio':>7}"
          f"{'bytes/step':>14}{'minimum':>14}  per kind")
    for layout, ref, t_sf, t_ref, moved, kinds in rows:
        least = "-" if layout.startswith(("mlp", "bound", "DDP")) else _min_bytes(cfg, layout, ranks)
        print(f"{layout:<18}{ref:<12}{t_sf * 1e3:>11.2f}{t_ref * 1e3:>10.2f}{t_sf / t_ref:>7.2f}"
              f"{moved:>14}{least:>14}  rank0: {kinds}")
    if ops:
        print(f"\nper-op eager time on small tensors, {ranks} ranks (us per call, best of 7 x "
              "500); overhead = time - torch kernel")
        print(f"  {'op':<8}{'sbpflow':>9}{'DTensor':>9}{'kernel':>8}{'sf ovh':>8}{'DT ovh':>8}"
              f"{'ratio':>7}")
        for name, (a, b, k) in ops.items():
            print(f"  {name:<8}{a * 1e6:>9.1f}{b * 1e6:>9.1f}{k * 1e6:>8.1f}"
                  f"{(a - k) * 1e6:>8.1f}{(b - k) * 1e6:>8.1f}{(a - k) / (b - k):>7.2f}")
    print(f"\nper-op time in graph mode vs eager on small tensors, {ranks} ranks (us per "
          "op, best of 7; graph: a build of 2000 ops less one of 1 op, over 1999); overhead = "
          "time - torch kernel; call: a one-op graph's call less its kernel, one call after "
          "a barrier (cold); warm: the mean of 200 calls in a row")
    print(f"  {'op':<8}{'graph':>8}{'eager':>8}{'kernel':>8}{'gr ovh':>8}{'eg ovh':>8}"
          f"{'ratio':>7}{'call':>9}{'warm':>8}")
    for name, (g, e, k, call, warm) in graph_ops.items():
        print(f"  {name:<8}{g * 1e6:>8.1f}{e * 1e6:>8.1f}{k * 1e6:>8.1f}{(g - k) * 1e6:>8.1f}"
              f"{(e - k) * 1e6:>8.1f}{(g - k) / (e - k):>7.2f}{call * 1e6:>9.1f}"
              f"{warm * 1e6:>8.1f}")


if __name__ == "__main__":
    sys.exit(main())
