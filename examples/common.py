"""Shared by the training examples: arguments, launching, layouts by name, the training loop
(eager, or one `sf.nn.Graph` call a step with ``--graph``) with its progress bar and summary.

A script defines ``main(args)`` — the body every rank runs — and ends with
``common.run(main, args)``, which runs it:

* directly, when this process already is a rank of a multi-rank world (``torchrun``,
  ``sbpflow run -n 4 [--backend torch] script.py``: `sf.init` joined it);
* else on ``-n`` new ranks with ``sf.launch`` (``--backend threads``, the default: one thread a
  rank in this process; ``--backend torch``: gloo processes).

Graph mode (``--graph``, ``--micro-batches``, ``--schedule``, ``--timeline``) and the pipeline
layouts (``pp``, ``pp-dp``: `pipeline_stages`) are described in docs/runtime.md, 'Graph mode'.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

import sbpflow as sf
from sbpflow.models import LAYOUT_NAMES, NamedLayout, layout
from sbpflow.runtime import in_flight

__all__ = ["parser", "run", "get_layout", "train", "accuracy", "TrainResult", "fmt_bytes",
           "on_rank0", "TrainStep", "PIPELINE_LAYOUTS", "Stages", "pipeline_stages"]

# layouts whose model is cut into stages on disjoint placements (`sf.parallel.pipeline`);
# a script that can split its model offers them (``parser(layouts=...)``)
PIPELINE_LAYOUTS = ("pp", "pp-dp")
DEFAULT_PIPELINE_MICRO_BATCHES = 8


def positive(kind=int):
    """An argparse type: a number of ``kind`` above 0 (a clear usage error otherwise)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def parser(description: str, *, layouts=LAYOUT_NAMES, layout_default: str = "dp",
           steps: int = 200, batch: int = 32, lr: float = 1e-3) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--layout", choices=list(layouts), default=layout_default,
                   help=f"how parameters and data are laid out over the ranks (default "
                        f"{layout_default}; see sbpflow.models.layout)")
    p.add_argument("-n", "--nproc", type=positive(), default=4,
                   help="ranks to launch (default 4; ignored inside a multi-rank world)")
    p.add_argument("--backend", choices=["threads", "torch"], default="threads",
                   help="threads (default): one thread a rank in this process; torch: gloo "
                        "processes")
    p.add_argument("--steps", type=positive(), default=None,
                   help=f"training steps, at most (default {steps}, or no limit with --seconds)")
    p.add_argument("--seconds", type=positive(float), default=None,
                   help="stop after this many seconds of training (whichever comes first)")
    p.set_defaults(default_steps=steps)
    p.add_argument("--batch", type=positive(), default=batch,
                   help=f"global batch size (default {batch})")
    p.add_argument("--lr", type=positive(float), default=lr, help=f"learning rate (default {lr:g})")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--no-bar", action="store_true", help="no progress bar")
    _graph_arguments(p)
    return p


def _graph_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graph mode (docs/runtime.md)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--graph", dest="graph", action="store_true", default=None,
                      help="run each step as one sf.nn.Graph call (compiled on the first step, "
                           "replayed after); implied by the pipeline layouts")
    mode.add_argument("--eager", dest="graph", action="store_false",
                      help="run eagerly (a pipeline layout then runs its stages one after "
                           "another)")
    g.add_argument("--micro-batches", type=positive(), default=None, metavar="K",
                   help="graph mode: split each batch into K micro-batches, accumulate their "
                        f"gradients, one update a step (default 1; "
                        f"{DEFAULT_PIPELINE_MICRO_BATCHES} for the pipeline layouts)")
    g.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b",
                   help="pipeline schedule in graph mode (default 1f1b)")
    g.add_argument("--timeline", default=None, metavar="PNG",
                   help="graph mode: save the last step's Gantt chart (a row a rank)")
    g.add_argument("--trace", default=None, metavar="JSON",
                   help="graph mode: save the last step's Chrome trace (opens in Perfetto)")
    g.add_argument("--show-graph", action="store_true",
                   help="graph mode: print the logical graph and rank 0's actors")


def _resolve(args) -> None:
    """Fill the graph-mode defaults that depend on the layout; refuse what cannot run."""
    pipelined = getattr(args, "layout", None) in PIPELINE_LAYOUTS
    if args.graph is None:
        args.graph = pipelined
    if args.micro_batches is None:
        args.micro_batches = DEFAULT_PIPELINE_MICRO_BATCHES if pipelined and args.graph else 1
    if not args.graph:
        asked = [o for o, v in (("--micro-batches", args.micro_batches > 1),
                                ("--timeline", args.timeline), ("--trace", args.trace),
                                ("--show-graph", args.show_graph)) if v]
        if asked:
            raise SystemExit(f"{', '.join(asked)} need graph mode: add --graph")


def run(main, args):
    """Run ``main(args)`` on every rank (see the module docstring); returns rank 0's result."""
    _resolve(args)
    sf.init()
    if sf.world_size() > 1:  # already a rank of a world: every rank runs the script
        if args.nproc != sf.world_size() and on_rank0():
            print(f"(running on the {sf.world_size()} ranks of this world; -n ignored)",
                  file=sys.stderr)
        return main(args)
    return sf.launch(main, world_size=args.nproc, backend=args.backend, args=(args,))[0]


def on_rank0() -> bool:
    return sf.rank() == 0


def get_layout(model: str, args) -> NamedLayout:
    """The named layout ``args.layout`` of ``model`` on this world's ranks (a layout the rank
    count cannot take ends the script with its message, as the pipeline layouts do)."""
    try:
        return layout(model, args.layout, sf.world_size())
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


class Stages(NamedTuple):
    """A pipeline layout: one placement a stage (disjoint ranks) and the inputs' nd-sbp on
    stage 0's placement, where the inputs are made."""

    name: str
    placements: list
    data_sbp: tuple

    def describe(self) -> str:
        where = " | ".join(",".join(map(str, p.flat_ranks)) for p in self.placements)
        return (f"layout {self.name}: {len(self.placements)} pipeline stages on ranks {where}, "
                f"inputs {self.data_sbp[0]!r}")


def pipeline_stages(name: str, world: int) -> Stages:
    """``pp``: ``world`` single-rank stages; ``pp-dp``: ``world // 2`` stages of two ranks
    each, data parallel inside a stage (parameters B, the batch split S(0))."""
    if name == "pp":
        if world < 2:
            raise SystemExit(f"layout pp needs at least 2 ranks (one a stage), not {world}")
        return Stages(name, [sf.placement("cpu", [r]) for r in range(world)], (sf.B,))
    if name == "pp-dp":
        if world < 4 or world % 2:
            raise SystemExit(f"layout pp-dp needs an even number of ranks >= 4 (stages of 2), "
                             f"not {world}")
        return Stages(name, [sf.placement("cpu", [r, r + 1]) for r in range(0, world, 2)],
                      (sf.S(0),))
    raise ValueError(f"unknown pipeline layout {name!r}; one of {PIPELINE_LAYOUTS}")


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
    mode: str = "eager"                          # or "graph"
    in_flight: dict = field(default_factory=dict)  # graph: stage -> peak micro-batches (last step)

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


class TrainStep(sf.nn.Graph):
    """One training step as a graph: ``loss = model(*inputs)``, ``loss.backward()``, then the
    optimizer's ``step()`` and ``zero_grad()`` (the graph runs them after ``build``).
    ``split_inputs``: which inputs are cut into micro-batches (`GraphConfig.set_split_inputs`;
    default: those whose axis 0 is the batch size)."""

    def __init__(self, model, opt, micro_batches: int = 1, schedule: str = "1f1b",
                 split_inputs: tuple | None = None) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(micro_batches)
        self.config.set_pipeline_schedule(schedule)
        if split_inputs is not None:
            self.config.set_split_inputs(*split_inputs)

    def build(self, *inputs):
        loss = self.model(*inputs)
        loss.backward()
        return loss


def _eager_step(model, opt):
    def step(*inputs):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        return loss
    return step


def train(model, opt, batch_fn, args, *, per_step: int, unit: str = "samples",
          desc: str = "train", split_inputs: tuple | None = None) -> TrainResult:
    """``args.steps`` steps (and/or until ``args.seconds``) of: ``loss = model(*batch_fn(step))``,
    backward, ``opt.step()`` — eagerly, or with ``args.graph`` as one `TrainStep` call a step
    (``args.micro_batches``, ``args.schedule``; ``split_inputs`` as `TrainStep`'s). Shows a
    progress bar on rank 0 (loss, ``unit``/s with ``per_step`` units a step) and prints a
    summary there. Returns a `TrainResult`."""
    res = TrainResult(unit=unit, mode="graph" if args.graph else "eager")
    graph = TrainStep(model, opt, args.micro_batches, args.schedule, split_inputs) \
        if args.graph else None
    _loop(graph or _eager_step(model, opt), batch_fn, args, res, per_step, desc)
    if on_rank0():
        first, last = res.losses[0][1], res.losses[-1][1]
        rate = f"{res.throughput:.0f} {unit}/s" if res.steps > 1 else f"no {unit}/s (1 step)"
        print(f"{desc}: {res.steps} steps in {res.seconds:.1f} s, loss {first:.4f} -> {last:.4f}, "
              f"{rate}")
        print(f"  communication: {res.comm_line()}")
    if graph is not None:
        _graph_report(graph, args, res)
    return res


def _loop(step_fn, batch_fn, args, res: TrainResult, per_step: int, desc: str) -> None:
    """Run the steps, filling ``res`` (losses, times, throughput, communication per step)."""
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
        value = step_fn(*batch_fn(step)).item()
        now = time.perf_counter() - t0
        after = sf.comm.stats()
        if step == 0:
            t_warm = now  # the first step also chooses signatures (compiles): not in the rates
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
                             f"{res.unit}/s": f"{res.throughput:.0f}" if step > 1 else "-"},
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


def _graph_report(graph: TrainStep, args, res: TrainResult) -> None:
    """Graph mode, after training (every rank: the timeline is collective): the in-flight
    micro-batches per stage of the last step, the graph and plan if asked, the saved files."""
    events = graph.timeline()
    res.in_flight = stage_in_flight(events)
    drawn = args.timeline
    if args.timeline:
        try:
            graph.save_timeline(args.timeline)  # rank 0 draws, after the ranks' exchange
        except ImportError:
            drawn = None
    if args.trace:
        graph.save_trace(args.trace)
    if not on_rank0():
        return
    if args.show_graph:
        print(graph)
        print(graph.plan())
    cfg = graph.config
    peaks = ", ".join(f"stage {s}: {n}" for s, n in sorted(res.in_flight.items()))
    print(f"  graph mode: {cfg.micro_batches} micro-batch(es) a step, schedule {cfg.schedule}; "
          f"last step's micro-batches holding activations at once (per rank): {peaks}")
    for path, what in ((drawn, "timeline"), (args.trace, "trace")):
        if path:
            print(f"  {what} of the last step saved to {path}")
    if args.timeline and not drawn:
        print("  (matplotlib is not installed: no timeline picture; --trace writes JSON)")


def stage_in_flight(events: list) -> dict:
    """Per stage, the peak micro-batches in flight on one of its ranks (`in_flight` counts a
    stage's ranks together: a stage of two ranks would read twice its budget)."""
    peak: dict = {}
    for r in sorted({e["rank"] for e in events}):
        for stage, n in in_flight([e for e in events if e["rank"] == r]).items():
            peak[stage] = max(peak.get(stage, 0), n)
    return peak
