"""GPT pipeline training step: sbpflow graph mode vs ``torch.distributed.pipelining``.

The GPT (`sbpflow.models.gpt_class`, the same weights) is cut into S stages (-n, a gloo process
each) at the same blocks: stage 0 = embeddings + its blocks, the last = its blocks + ln_f + head.
sbpflow: `sf.parallel.pipeline` + an `sf.nn.Graph` (M micro-batches, 1F1B or GPipe); torch:
`PipelineStage` with `Schedule1F1B` / `ScheduleGPipe`, the loss on the last stage. Same batch,
fused AdamW (sbpflow's default on a CPU), mean loss (torch's ``scale_grads``). Prints median
step times (barrier to barrier, taking turns), their ratio, the first losses and the most
micro-batches each sbpflow stage held (its timeline). ``--profile``: per rank, wall and CPU,
forward / backward / update time, hop latencies, thread CPU by kind and the runtime's start
handshake, for both (wraps runtime internals: `_profile_rank`).

    python benchmarks/pipeline.py [--d 64] [--layers 4] [--batch 32] [--seq 32] [--steps 15]
                                  [--micro-batches 8 16] [-n 4] [--timeline t.png] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

import sbpflow as sf
from timing import take_turns
from sbpflow.models import gpt_class
from sbpflow.runtime import in_flight


def _timed(steps_to_time: list, steps: int) -> tuple[list[float], float]:
    """Median seconds per step of each step function (`timing.take_turns`), and the median of
    the per-turn ratios A / B (each pair ran within a fraction of a second: load from outside
    cancels)."""
    times = take_turns(steps_to_time, steps)
    paired = statistics.median(a / b for a, b in zip(times[0], times[1]))
    return [statistics.median(ts) for ts in times], paired


def _data(cfg: dict, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _split_names(layers: int, stages: int) -> list[str]:
    """The first block of each stage after the first: blocks spread evenly, the earlier
    stages taking one more when they do not divide (stage 0 also has the embeddings, the
    last the head)."""
    per, extra = divmod(layers, stages)
    firsts, at = [], 0
    for s in range(stages - 1):
        at += per + (s < extra)
        firsts.append(at)
    return [f"blocks.{i}" for i in firsts]


# -- sbpflow ----------------------------------------------------------------------------------
def _torch_gpt(cfg: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt_class(torch.nn, torch.nn.functional)(cfg["vocab"], cfg["d"], cfg["heads"],
                                                    cfg["layers"], cfg["seq"])


def _sf_step(cfg: dict, m: int, schedule: str):
    """The sbpflow graph-mode step (a callable returning the loss, a global tensor on the last
    stage) and its graph; the weights are the torch twin's. The loss is computed in ``build``
    from the logits and targets held by the last stage, as torch's schedule does
    (``cfg["targets_in_model"]``: passed to the model with the tokens, so the graph sends them
    from the first stage to the last, a transfer a micro-batch)."""
    n = sf.comm.current().world_size
    stages = [sf.placement("cpu", [r]) for r in range(n)]
    model = gpt_class(sf.nn, sf.nn.functional)(cfg["vocab"], cfg["d"], cfg["heads"],
                                               cfg["layers"], cfg["seq"])
    model.load_state_dict(_torch_gpt(cfg).state_dict())  # the same on every rank
    sf.parallel.pipeline(model, stages, split=_split_names(cfg["layers"], n))
    opt = sf.optim.AdamW(model.parameters(), lr=1e-3)

    class TrainStep(sf.nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(m)
            self.config.set_pipeline_schedule(schedule)
            self.config.set_split_inputs(True, False, True)  # positions go whole

        def build(self, x, pos, y):
            if in_model:
                loss = self.model(x, pos, y)
            else:
                logits = self.model(x, pos)
                loss = sf.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                      y.reshape(-1))
            loss.backward()
            return loss

    in_model = cfg.get("targets_in_model", False)
    graph = TrainStep()
    x, y = _data(cfg)
    # targets given to the model go on its first stage (the pipeline moves its inputs there:
    # on the last stage they would go to the first and back, refused as a cycle)
    xs, ys = sf.tensor(x, stages[0], sf.B), sf.tensor(y, stages[0 if in_model else -1], sf.B)
    pos = sf.arange(cfg["seq"], placement=stages[0], sbp=sf.B)
    return (lambda: graph(xs, pos, ys)), graph


# -- torch.distributed.pipelining -------------------------------------------------------------
class _Stage(torch.nn.Module):
    """A stage of the torch GPT: its blocks, with the embeddings before them (first stage) and
    ln_f + head after them (last stage); the forward passes the activation (the logits last)."""

    def __init__(self, gpt: torch.nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos = gpt.tok, gpt.pos
            self.register_buffer("positions", torch.arange(gpt.pos.num_embeddings))
        self.blocks = torch.nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(self.positions[:x.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def _torch_step(cfg: dict, m: int, schedule: str):
    """The torch pipelining step of this rank (a callable returning the loss on the last
    stage, else None), the rank's stage module and its optimizer."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    r, n = dist.get_rank(), dist.get_world_size()
    gpt = _torch_gpt(cfg)
    bounds = [0] + [int(s.split(".")[1]) for s in _split_names(cfg["layers"], n)] + \
        [cfg["layers"]]
    module = _Stage(gpt, bounds[r], bounds[r + 1], r == 0, r == n - 1)
    del gpt
    stage = PipelineStage(module, r, n, torch.device("cpu"))
    vocab = cfg["vocab"]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, fused=True)
    x, y = _data(cfg)

    def step() -> torch.Tensor | None:
        losses: list = []
        if r == 0:
            sched.step(x)
        elif r == n - 1:
            sched.step(target=y, losses=losses, return_outputs=False)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).mean().detach() if losses else None
    return step, module, opt


# -- the benchmark ----------------------------------------------------------------------------
def _first_losses(sf_loss, torch_loss) -> tuple[float, float]:
    """Both first steps' losses on every rank (the last stage has them): the same weights and
    batch, so they agree to float32 rounding (a check that both run the same step)."""
    both = torch.zeros(2)
    if dist.get_rank() == dist.get_world_size() - 1:
        both[0], both[1] = sf_loss.local.item(), torch_loss.item()
    dist.all_reduce(both)
    return both[0].item(), both[1].item()


def _bench(cfg: dict, steps: int, mbs: list[int], timeline: str | None):
    import logging
    torch._logging.set_logs(all=logging.ERROR)
    rows = []
    for m in mbs:
        for schedule in ("1f1b", "gpipe"):
            sf_step, graph = _sf_step(cfg, m, schedule)
            torch_step = _torch_step(cfg, m, schedule)[0]
            first = _first_losses(sf_step(), torch_step())
            (t_sf, t_torch), paired = _timed([sf_step, torch_step], steps)
            events = graph.timeline()  # collective: every rank
            peaks = in_flight(events)
            rows.append((schedule, m, t_sf, t_torch, paired,
                         [peaks.get(s) for s in sorted(peaks)], first))
            if timeline and schedule == "1f1b" and m == mbs[0]:
                graph.save_timeline(timeline)
    return rows if dist.get_rank() == 0 else None


# -- where the time goes (--profile) ------------------------------------------------------------
_CLOCK = time.time() - time.perf_counter()  # perf_counter is per process: one clock for all


def _thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each live thread of this process, summed by kind: "compute" (the
    runtime's compute queue), "transfer" (its send / recv queues), "inbox" (its message reader
    and the store channel readers), "main", "gloo" (gloo's I/O threads), "other" (Linux:
    /proc/self/task; clock ticks, so read it over many steps)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), comm)
        kind = ("compute" if name.endswith("-compute") else
                "transfer" if "-send>" in name or "-recv<" in name or "-grad" in name else
                "inbox" if name.endswith("-inbox") or name.startswith("sbpflow-channel") else
                "main" if name == "MainThread" else "gloo" if "gloo" in comm else "other")
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class _TorchEvents:
    """Forward, backward and update events of a torch stage module and its optimizer, as
    the sbpflow timeline's (micro-batches counted per step): forward from the module's hooks,
    backward from the first gradient of its output to the last parameter gradient accumulated
    (what comes after, the input's gradient, is left out: a slight underestimate)."""

    def __init__(self, module: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
        self.rank, self.events, self.fwd = rank, [], 0
        self._start = 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._grad)
        opt.register_step_pre_hook(lambda *a: self._pre(None, None))
        opt.register_step_post_hook(lambda *a: self._event("update", 0, self._start))

    def new_step(self) -> None:
        self.events, self.fwd = [], 0

    def _event(self, kind: str, mb: int, start: float) -> dict:
        e = {"rank": self.rank, "stage": self.rank, "kind": kind, "micro_batch": mb,
             "start": start + _CLOCK, "end": time.perf_counter() + _CLOCK}
        self.events.append(e)
        return e

    def _pre(self, module, args) -> None:
        self._start = time.perf_counter()

    def _post(self, module, args, out) -> None:
        mb = self.fwd
        self._event("forward", mb, self._start)
        self.fwd += 1
        out.register_hook(lambda g: self._backward_starts(mb))

    def _backward_starts(self, mb: int) -> None:
        self._open = self._event("backward", mb, time.perf_counter())

    def _grad(self, p) -> None:  # the last parameter's ends the micro-batch's backward
        self._open["end"] = time.perf_counter() + _CLOCK


def _summary(events: list[dict], rank: int, stages: int) -> dict:
    """Per-step figures of ``rank`` from one step's events (every rank's, one clock)."""
    mine = [e for e in events if e["rank"] == rank]
    busy = lambda kind: sum(e["end"] - e["start"] for e in mine if e["kind"] == kind)  # noqa
    at = {(e["kind"], e["rank"], e["micro_batch"]): e for e in events
          if e["kind"] in ("forward", "backward")}
    hops_f, hops_b = [], []  # from this rank's forwards and backwards
    for (kind, r, mb), e in at.items():
        if r == rank and kind == "forward" and ("forward", r + 1, mb) in at:
            hops_f.append(at[("forward", r + 1, mb)]["start"] - e["end"])
        if r == rank and kind == "backward" and ("backward", r - 1, mb) in at:
            hops_b.append(at[("backward", r - 1, mb)]["start"] - e["end"])
    return {"fwd": busy("forward"), "bwd": busy("backward"), "update": busy("update"),
            "hop_f": hops_f, "hop_b": hops_b, **_handoffs(events, rank)}


def _handoffs(events: list[dict], rank: int) -> dict:
    """sbpflow's two parts of a hop (its timeline names the transfer actors): ``hop_send``,
    from a forward's (backward's) end to the start of the send of its value, here (the wake-up
    of the send thread); ``hop_wire``, from that start to the end of the receive on the other
    rank (gloo and the receiving thread's wake-up). Empty for torch's events."""
    at = {(e["rank"], e["actor"], e["micro_batch"]): e for e in events if "actor" in e}
    to_send, wire = [], []
    for (r, actor, mb), e in at.items():
        if r != rank or not actor.startswith(("send>", "gradsend>")):
            continue
        made = at.get((r, "fwd" if actor[0] == "s" else "bwd", mb))
        peer = int(actor.rpartition(">")[2])
        got = at.get((peer, f"{'recv' if actor[0] == 's' else 'gradrecv'}<{r}", mb))
        if made is not None:
            to_send.append(e["start"] - made["end"])
        if got is not None:
            wire.append(got["end"] - e["start"])
    return {"hop_send": to_send, "hop_wire": wire}


class _RuntimeMarks:
    """Times of this rank's last graph run: ``run`` / ``ran`` around `Runtime.run`, ``started``
    when the last peer's start message arrived (gated actors, send / recv, wait for it).
    Wraps the runtime's private ``RunMessages._on_start`` while in a ``with`` block."""

    def __init__(self, runtime) -> None:
        self.marks: dict[str, float] = {}
        self.runtime = runtime
        run = runtime.run

        def timed_run(k):
            self.marks["run"] = time.perf_counter()
            try:
                return run(k)
            finally:
                self.marks["ran"] = time.perf_counter()
        runtime.run = timed_run

    def __enter__(self) -> "_RuntimeMarks":
        from sbpflow.runtime import messaging
        self._step = messaging.RunMessages
        self._on_start = on_start = self._step._on_start
        marks = self.marks

        def _on_start(step, src):
            on_start(step, src)
            if not step.unstarted and "started" not in marks:
                marks["started"] = time.perf_counter()
        self._step._on_start = _on_start
        return self

    def __exit__(self, *exc) -> None:
        self._step._on_start = self._on_start

    def figures(self, wall: float) -> dict:
        """``outside``: the call's time outside `Runtime.run`; ``head``: from the run's start
        to its first firing; ``tail``: from its last firing's end to its return."""
        m, events = self.marks, self.runtime.timeline()  # this rank's, on its perf_counter
        return {"outside": wall - (m["ran"] - m["run"]),
                "handshake": m.get("started", m["run"]) - m["run"],
                "head": min(e["start"] for e in events) - m["run"],
                "tail": m["ran"] - max(e["end"] for e in events)}


def _profile_rank(cfg: dict, m: int, schedule: str, steps: int) -> dict:
    """This rank's figures for the sbpflow and the torch step (taking turns, as `_timed`):
    the medians of `_summary`'s, wall, process CPU, and per thread kind the mean CPU a step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    sf_step, graph = _sf_step(cfg, m, schedule)
    torch_step, module, opt = _torch_step(cfg, m, schedule)
    hooks = _TorchEvents(module, opt, rank)
    for _ in range(2):
        sf_step(), torch_step()
    rows: dict[str, list] = {"sbpflow": [], "torch": []}
    cpu: dict[str, dict] = {"sbpflow": {}, "torch": {}}
    last: dict[str, list] = {}  # the last step's events of every rank
    with _RuntimeMarks(next(iter(graph._compiled.values())).runtime) as marks:
        for _ in range(steps):
            for name, step in (("sbpflow", sf_step), ("torch", torch_step)):
                hooks.new_step()
                marks.marks.clear()
                dist.barrier()
                before = _thread_cpu()
                c, t = time.process_time(), time.perf_counter()
                step()
                t, c = time.perf_counter() - t, time.process_time() - c
                for k, v in _thread_cpu().items():
                    cpu[name][k] = cpu[name].get(k, 0.0) + (v - before.get(k, 0.0)) / steps
                if name == "sbpflow":
                    events, extra = graph.timeline(), marks.figures(t)  # collective
                else:
                    events, extra = [e for evs in _all_gather(hooks.events) for e in evs], {}
                rows[name].append(dict(_summary(events, rank, n), wall=t, cpu=c, **extra))
                last[name] = events
    return {name: dict(_medians(rs), threads=cpu[name], events=last[name])
            for name, rs in rows.items()}


def _medians(rows: list[dict]) -> dict:
    """The median of each figure over the steps (of every hop of every step, for the hops)."""
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0] if not k.startswith("hop")}
    for k in ("hop_f", "hop_b", "hop_send", "hop_wire"):
        hops = [h for r in rows for h in r.get(k, [])]
        out[k] = statistics.median(hops) if hops else float("nan")
    return out


def _all_gather(obj) -> list:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, obj)
    return got


def _save_both(profile: dict, path: str, config: str) -> None:
    """The last profiled step's Gantt charts: sbpflow's at ``path``, torch's (forward,
    backward and update only: what its hooks see) beside it, ``-torch`` before the suffix."""
    from sbpflow.runtime import save_timeline
    root, dot, ext = path.rpartition(".")
    other = f"{root}-torch.{ext}" if dot else f"{path}-torch"
    for name, where in (("sbpflow", path), ("torch", other)):
        save_timeline(profile[name]["events"], where, title=f"{name}: {config}")
    print(f"timelines of the last profiled {config} step: {path}, {other}")


def _print_profile(config: str, per_rank: list[dict]) -> None:
    ms = lambda v: f"{v * 1e3:6.1f}"  # noqa: E731
    print(f"\n{config}: per rank, medians per step (ms); hop = a micro-batch's forward (backward)"
          " start on the next (previous) stage minus its end here; sbpflow's hops from here in"
          " two parts: to send (its value's end to its send's start), wire (that start to the "
          "receive's end there)")
    print(f"{'':<9}{'rank':>4}{'wall':>7}{'cpu':>7}{'fwd':>7}{'bwd':>7}{'update':>7}"
          f"{'hop f':>7}{'hop b':>7}  sbpflow: to send / wire; outside run / handshake / head / "
          f"tail; thread cpu")
    for name in ("sbpflow", "torch"):
        for r, res in enumerate(per_rank):
            v = res[name]
            line = (f"{name if r == 0 else '':<9}{r:>4}" + "".join(
                ms(v[k]) + " " for k in ("wall", "cpu", "fwd", "bwd", "update", "hop_f", "hop_b")))
            if name == "sbpflow":
                line += " " + " / ".join(f"{v[k] * 1e3:.2f}" for k in ("hop_send", "hop_wire"))
                line += "; " + " / ".join(f"{v[k] * 1e3:.2f}" for k in (
                    "outside", "handshake", "head", "tail")) + "; "
            line += " ".join(f"{k} {t * 1e3:.1f}" for k, t in sorted(
                v["threads"].items(), key=lambda kv: -kv[1]) if t > 0)
            print(line)
        total, cores = sum(res[name]["cpu"] for res in per_rank), os.cpu_count() or 1
        print(f"{'':<9} all   CPU of the ranks together {total * 1e3:.1f} ms a step: at least "
              f"{total / cores * 1e3:.1f} ms on {cores} cores")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("-n", "--ranks", type=int, default=4, help="stages, a gloo process each")
    ap.add_argument("--timeline", help="write the first M's 1F1B step's Gantt chart (PNG; with "
                                       "--profile, torch's too)")
    ap.add_argument("--targets-in-model", action="store_true",
                    help="sbpflow: the model computes the loss (the targets go from the first "
                         "stage to the last)")
    ap.add_argument("--profile", action="store_true",
                    help="instead: per rank, where each step's time goes (both frameworks)")
    args = ap.parse_args(argv)
    if args.layers < args.ranks:
        ap.error(f"--layers {args.layers}: each of the {args.ranks} stages needs a block")
    bad = [m for m in args.micro_batches if args.batch % m]
    if bad:
        ap.error(f"--batch {args.batch} must divide by the micro-batches {bad} (torch's "
                 "schedules split it evenly)")
    cfg = dict(vocab=args.vocab, d=args.d, heads=args.heads, layers=args.layers,
               batch=args.batch, seq=args.seq, targets_in_model=args.targets_in_model)
    print(f"GPT d={args.d} layers={args.layers} heads={args.heads} batch={args.batch} "
          f"seq={args.seq} vocab={args.vocab}; {args.ranks} stages, a gloo process each "
          f"(split at {_split_names(args.layers, args.ranks)}); median of {args.steps} steps, "
          f"sbpflow and torch taking turns")
    if args.profile:
        for m in args.micro_batches:
            for schedule in ("1f1b", "gpipe"):
                per_rank = sf.launch(_profile_rank, world_size=args.ranks, backend="torch",
                                     args=(cfg, m, schedule, args.steps))
                _print_profile(f"{schedule} M={m}", per_rank)
                if args.timeline and (m, schedule) == (args.micro_batches[0], "1f1b"):
                    _save_both(per_rank[0], args.timeline, f"{schedule}, M = {m}")
        return 0
    rows = sf.launch(_bench, world_size=args.ranks, backend="torch",
                     args=(cfg, args.steps, args.micro_batches, args.timeline))[0]
    print(f"{'schedule':<9}{'M':>3}{'sbpflow ms':>11}{'torch ms':>10}{'ratio':>7}{'paired':>7}"
          f"{'1st loss sf / torch':>22}  sbpflow in flight per stage")
    for schedule, m, t_sf, t_torch, paired, peaks, (l_sf, l_torch) in rows:
        print(f"{schedule:<9}{m:>3}{t_sf * 1e3:>11.1f}{t_torch * 1e3:>10.1f}"
              f"{t_sf / t_torch:>7.2f}{paired:>7.2f}{l_sf:>11.5f} / {l_torch:<8.5f}  {peaks}")
    print("(ratio: of the medians; paired: the median of each turn's sbpflow / torch)")
    print("(in flight: micro-batches whose forward started and backward had not ended, per "
          "stage; 1F1B's bound is S - s, GPipe's M)")
    if args.timeline:
        print(f"timeline of the 1F1B M={args.micro_batches[0]} step: {args.timeline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
