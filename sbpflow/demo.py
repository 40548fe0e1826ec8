"""`sbpflow demo`: boxing on simulated ranks, a GPT trained in a 2-D hybrid layout, then the
same kind of GPT as a 4-stage pipeline in graph mode.

1. Boxing: each row plans a redistribution of one tensor, runs it on 4 in-process ranks,
   checks the logical value is unchanged and that the bytes the communicator counted equal
   the plan's cost.
2. Training: a small character-level GPT (`sbpflow.models`) on a generated corpus, on 4
   simulated ranks as a 2×2 mesh for ``--seconds`` (default 60): the loss curve, the
   communication per step by kind, a generated sample, a loss plot (``--plot``).
3. Pipeline: a 4-block GPT cut into 4 single-rank stages (`sf.parallel.pipeline`), each step
   one `sf.nn.Graph` call of 8 micro-batches under 1F1B, then one GPipe step: the losses, the
   micro-batches in flight per stage read from the timeline, and the last 1F1B step's Gantt
   chart (``--timeline``). See docs/runtime.md, 'Graph mode'.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from . import comm as _comm
from . import nn, optim, parallel
from .boxing import plan
from .runtime import in_flight
from .models import CharData, char_corpus, generate, gpt_class, layout, param_count
from .placement import placement
from .sbp import B, P, S, format_nd_sbp
from .tensor import arange, from_local, manual_seed, randn, tensor

__all__ = ["main", "add_arguments", "train_gpt", "pipeline_gpt", "PipelineStep"]

LINE = placement("cpu", [0, 1, 2, 3])
MESH = placement("cpu", [[0, 1], [2, 3]])
PAIR_A, PAIR_B = placement("cpu", [0, 1]), placement("cpu", [2, 3])

CASES = [
    ("split to split (all-to-all)", LINE, (S(0),), LINE, (S(1),)),
    ("split to broadcast (all-gather)", LINE, (S(0),), LINE, (B,)),
    ("partial to broadcast (all-reduce)", LINE, (P,), LINE, (B,)),
    ("partial to split (reduce-scatter)", LINE, (P,), LINE, (S(0),)),
    ("broadcast to partial (free)", LINE, (B,), LINE, (P,)),
    ("2x2: (S0,S1) -> (B,S0)", MESH, (S(0), S(1)), MESH, (B, S(0))),
    ("2x2: (P,P) -> (B,B), one all-reduce", MESH, (P, P), MESH, (B, B)),
    ("2x2: (S0,S1) -> (S1,S0), shards only", MESH, (S(0), S(1)), MESH, (S(1), S(0))),
    ("2x2: (S0,S0) -> (B,S0)", MESH, (S(0), S(0)), MESH, (B, S(0))),
    ("pipeline hop: [0,1] P -> [2,3] B", PAIR_A, (P,), PAIR_B, (B,)),
    ("1-D to 2-D: S0 -> (S0,S1)", LINE, (S(0),), MESH, (S(0), S(1))),
]
SHOWN = 5  # the case whose plan is printed in full

SHAPE = (1024, 768)

# the demo's GPT: ~0.1 s a step on 4 simulated ranks on 2 cores
GPT_CONFIG = dict(d=64, heads=4, layers=2, seq=64, batch=16, lr=3e-3)
# the pipeline section's GPT: one block a stage, 8 micro-batches of 2 sequences
PIPE_CONFIG = dict(d=64, heads=4, layers=4, seq=64, batch=16, lr=3e-3, micro_batches=8)
PIPE_SPLIT = ["blocks.1", "blocks.2", "blocks.3"]


# -- 1. boxing ------------------------------------------------------------------------------------
def _run_case(src_pl, src, dst_pl, dst):
    x = randn(*SHAPE, placement=src_pl, sbp=tuple(B if s == P else s for s in src), seed=0)
    if P in src:
        # a genuinely partial tensor: the ranks of the P dims each hold an equal part
        n = math.prod(m for s, m in zip(src, src_pl.shape) if s == P)
        x = from_local(x.local / n, src_pl, src, shape=SHAPE)
    ref = x.full_tensor()
    _comm.reset_stats()
    y = x.to_global(dst_pl, dst)
    counted = _comm.stats().sent
    ok = torch.allclose(y.full_tensor(), ref, atol=1e-5)
    return counted, ok


def boxing_section() -> bool:
    """Print the boxing table; returns whether every row kept the value and its planned bytes."""
    print(f"== 1. boxing a {SHAPE[0]}x{SHAPE[1]} float32 tensor "
          f"({SHAPE[0] * SHAPE[1] * 4 / 2**20:.1f} MiB) on 4 simulated ranks (threads backend)\n")
    title, spl, s, dpl, d = CASES[SHOWN]
    print(f"for example, {title}:")
    print(plan(SHAPE, torch.float32, (spl, s), (dpl, d)))
    print()
    print(f"{'transition':<38} {'steps':<27} {'planned MiB':>11} {'counted MiB':>11}  check")
    all_ok = True
    for title, spl, s, dpl, d in CASES:
        per_rank = _comm.launch(_run_case, 4, args=(spl, s, dpl, d))
        counted, ok = sum(c for c, _ in per_rank), all(ok for _, ok in per_rank)
        p = plan(SHAPE, torch.float32, (spl, s), (dpl, d))
        good = ok and counted == p.nbytes
        all_ok &= good
        steps = " + ".join(st.kind for st in p.steps) or "-"
        verdict = "ok" if good else ("VALUE CHANGED" if not ok else "BYTES != PLANNED")
        print(f"{title:<38} {steps:<27} {p.nbytes / 2**20:>11.2f} {counted / 2**20:>11.2f}  "
              f"{verdict}")
    print("(ok: the value is unchanged on every rank and the bytes counted equal the plan's)\n")
    return all_ok


# -- 2. training ----------------------------------------------------------------------------------
def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (ranks must agree on stopping)."""
    c = _comm.current()
    if c.world_size == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    return bool(c.all_reduce(t, tuple(range(c.world_size)), op="max").item() > 0)


def train_gpt(seconds: float, max_steps: int = 10**9, lines: int = 10,
              sample: int = 60, verbose: bool = True) -> dict:
    """Runs on every rank (inside `launch`): trains the demo GPT in the 2×2 layout for
    ``seconds`` (or ``max_steps``, if fewer); rank 0 prints ``lines`` loss lines as it goes.
    Returns the losses, times and this rank's bytes sent per step by kind."""
    cfg = GPT_CONFIG
    data = CharData(char_corpus(), cfg["seq"], cfg["batch"])
    lay = layout("gpt", "2d", _comm.world_size())
    manual_seed(0)
    model = gpt_class(nn, nn.functional)(data.vocab, cfg["d"], cfg["heads"], cfg["layers"],
                                         cfg["seq"])
    parallel.apply(model, lay.placement, lay.rules, zero=lay.zero)
    opt = optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    pos = arange(cfg["seq"], placement=lay.placement, sbp=(B, B))
    talk = verbose and _comm.rank() == 0
    if talk:
        _print_setup(model, data, lay, seconds, max_steps)
    losses, times, comm_sum = [], [], {}
    t0 = time.perf_counter()
    next_line, step, t_warm = 0.0, 0, 0.0
    while True:
        before = _comm.stats()
        x, y = data.batch(step)
        loss = model(tensor(x, lay.placement, lay.data_sbp), pos,
                     tensor(y, lay.placement, lay.data_sbp))
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
        now = time.perf_counter() - t0
        after = _comm.stats()
        if step == 0:
            t_warm = now  # the first step also chooses every op's signature
        else:
            _add_traffic(comm_sum, before, after)
        losses.append(value)
        times.append(now)
        step += 1
        done = _any_rank(now >= seconds) or step >= max_steps
        if talk and (now >= next_line or done):
            print(f"   {step:>6} {value:>8.4f} {now:>8.1f}", flush=True)
            next_line = now + seconds / lines if step > 1 else seconds / lines
        if done:
            break
    measured = max(step - 1, 1)
    text = generate(model, data, lay.placement, "the ", sample) if sample else ""
    return dict(losses=losses, times=times, steps=step, warmup=t_warm, vocab=data.vocab,
                tokens_per_step=cfg["batch"] * cfg["seq"], sample=text,
                comm={k: (s / measured, c / measured) for k, (s, c) in comm_sum.items()})


def _print_setup(model, data: CharData, lay, seconds: float, max_steps: int) -> None:
    """Rank 0's header of the training section: the model, the corpus, the layout."""
    cfg = GPT_CONFIG
    print(f"== 2. training a GPT: {param_count(model):,} parameters (d={cfg['d']}, "
          f"{cfg['heads']} heads, {cfg['layers']} layers, vocab {data.vocab}), "
          f"sequences of {cfg['seq']} characters, batch {cfg['batch']}, AdamW, for "
          f"{seconds:g} s" + (f" or {max_steps} steps" if max_steps < 10**9 else ""))
    print(f"   corpus: {len(data.data):,} generated characters, e.g. "
          f"{data.decode(data.data[:60])!r}")
    print(f"   4 simulated ranks as a 2x2 mesh {lay.placement}: data parallel across the "
          f"groups, Megatron tensor parallel inside each")
    for pattern, nd in lay.rules.items():
        print(f"     {pattern:<22} {format_nd_sbp(nd)}")
    print(f"     tokens, targets        {format_nd_sbp(lay.data_sbp)}\n")
    print(f"   {'step':>6} {'loss':>8} {'seconds':>8}")


def _add_traffic(comm_sum: dict, before, after) -> None:
    """Add one step's bytes sent and calls per kind (``after - before`` of `sf.comm.stats`) to
    ``comm_sum`` = ``{kind: (bytes, calls)}``."""
    for kind, k in after.kinds.items():
        b = before[kind]
        s, c = comm_sum.get(kind, (0, 0))
        comm_sum[kind] = (s + k.sent - b.sent, c + k.calls - b.calls)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _report(results: list, plot_path: str | None) -> None:
    r0 = results[0]
    steps, times = r0["steps"], r0["times"]
    rate = r0["tokens_per_step"] * (steps - 1) / max(times[-1] - r0["warmup"], 1e-9)
    losses = r0["losses"]
    tail = losses[-max(1, min(20, len(losses) // 5)):]
    print(f"\n   {steps} steps in {times[-1]:.1f} s ({r0['warmup']:.1f} s of it the first step), "
          f"{rate:,.0f} tokens/s; loss {losses[0]:.3f} -> {sum(tail) / len(tail):.3f} "
          f"(mean of the last {len(tail)} steps; ln(vocab) = "
          f"{math.log(r0['vocab']):.3f} is chance)")
    if r0["sample"]:
        print(f"   greedy sample: {r0['sample']!r}")
    print("\n   communication per training step (after the first), by collective kind:")
    kinds = sorted(set().union(*(r["comm"] for r in results)))
    print(f"     {'kind':<16} {'calls':>6} {'rank 0 sent':>12} {'all ranks sent':>15}")
    total0 = total = 0.0
    for kind in kinds:
        sent0, calls0 = r0["comm"].get(kind, (0, 0))
        everyone = sum(r["comm"].get(kind, (0, 0))[0] for r in results)
        total0, total = total0 + sent0, total + everyone
        print(f"     {kind:<16} {calls0:>6.0f} {_mib(sent0):>12} {_mib(everyone):>15}")
    print(f"     {'total':<16} {'':>6} {_mib(total0):>12} {_mib(total):>15}")
    print("   (inside each group: the activations' partial sums after the row-parallel layers,\n"
          "    reduced forward and backward; across the groups: the parameters' gradients,\n"
          "    all-reduced by the optimizer in buckets; plus the scalar loss)")
    if plot_path:
        _plot(losses, times, plot_path)


def _plot(losses: list, times: list, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n   (matplotlib is not installed: no loss plot; pip install matplotlib, or "
              "install sbpflow[dev])")
        return
    k = max(1, len(losses) // 50)
    smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
              for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(losses) + 1)
    if k > 1:
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=0.8, label="loss")
        ax.plot(steps, smooth, color="tab:blue", lw=1.8, label=f"mean of {k} steps")
    else:
        ax.plot(steps, losses, color="tab:blue", lw=1.5, label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / character)")
    ax.set_title(f"sbpflow demo: GPT on 4 simulated ranks, 2x2 mesh ({times[-1]:.0f} s)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"\n   loss plot saved to {path}")


# -- 3. pipeline ----------------------------------------------------------------------------------
class PipelineStep(nn.Graph):
    """One training step of the pipelined GPT: 8 micro-batches under ``schedule``."""

    def __init__(self, model, opt, schedule: str) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(opt)
        self.config.set_gradient_accumulation_steps(PIPE_CONFIG["micro_batches"])
        self.config.set_pipeline_schedule(schedule)
        self.config.set_split_inputs(True, False, True)  # positions go whole to each

    def build(self, x, pos, y):
        loss = self.model(x, pos, y)
        loss.backward()
        return loss


def pipeline_gpt(steps: int, timeline: str | None) -> dict:
    """Runs on every rank (inside `launch`): the pipelined GPT trained ``steps`` 1F1B steps,
    then one GPipe step (a graph of its own over the same model). Returns, per schedule, the
    losses, the step times and the in-flight peaks per stage of its last step; saves the last
    1F1B step's timeline to ``timeline`` (rank 0 writes; `Graph.save_timeline` is collective).
    """
    cfg = PIPE_CONFIG
    data = CharData(char_corpus(), cfg["seq"], cfg["batch"])
    stages = [placement("cpu", [r]) for r in range(_comm.world_size())]
    manual_seed(0)
    model = gpt_class(nn, nn.functional)(data.vocab, cfg["d"], cfg["heads"], cfg["layers"],
                                         cfg["seq"])
    parallel.pipeline(model, stages, split=PIPE_SPLIT)
    opt = optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    pos = arange(cfg["seq"], placement=stages[0], sbp=B)
    out, done = {"params": param_count(model), "vocab": data.vocab}, 0
    for schedule, n in (("1f1b", steps), ("gpipe", 1)):
        step, losses, times = PipelineStep(model, opt, schedule), [], []
        for i in range(done, done + n):
            x, y = data.batch(i)
            t = time.perf_counter()
            losses.append(step(tensor(x, stages[0], B), pos, tensor(y, stages[0], B)).item())
            times.append(time.perf_counter() - t)
        done += n
        out[schedule] = dict(losses=losses, times=times, in_flight=in_flight(step.timeline()))
        if schedule == "1f1b" and timeline:
            out["saved"] = _save_timeline(step, timeline)
    return out


def _save_timeline(step: nn.Graph, path: str) -> str:
    """Save ``step``'s last timeline (every rank calls: it is collective); '' if it could
    not be drawn (no matplotlib), else ``path``."""
    try:
        step.save_timeline(path)
    except ImportError:
        return ""
    return path


def _report_pipeline(r0: dict) -> None:
    cfg, s = PIPE_CONFIG, len(PIPE_SPLIT) + 1
    print(f"\n== 3. a pipeline: a GPT of {r0['params']:,} parameters ({cfg['layers']} blocks), "
          f"cut into {s} stages, one a rank ({', '.join(PIPE_SPLIT)} start stages 1-{s - 1}); "
          f"each step one sf.nn.Graph call of {cfg['micro_batches']} micro-batches")
    print(f"\n   {'schedule':<8} {'step':>4} {'loss':>8} {'ms':>8}")
    for schedule in ("1f1b", "gpipe"):
        for i, (loss, t) in enumerate(zip(r0[schedule]["losses"], r0[schedule]["times"])):
            note = "  (compiles: traces build, plans the actors)" if i == 0 else ""
            print(f"   {schedule:<8} {i + 1:>4} {loss:>8.4f} {t * 1e3:>8.1f}{note}")
    print("\n   micro-batches holding activations at once, per stage (from the last step's "
          "timeline):")
    for schedule, why in (("1f1b", f"stage s keeps at most {s} - s: its register budget"),
                          ("gpipe", "every forward before the first backward")):
        peaks = r0[schedule]["in_flight"]
        print(f"     {schedule:<6} " + " ".join(f"{peaks.get(i, 0):>2}" for i in range(s)) +
              f"   ({why})")
    if r0.get("saved"):
        print(f"\n   the last 1F1B step's timeline (a row a rank) saved to {r0['saved']}")
    elif "saved" in r0:
        print("\n   (matplotlib is not installed: no timeline picture)")


# -- command line ---------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--seconds", type=float, default=60.0,
                   help="how long to train the GPT (default 60)")
    p.add_argument("--plot", default="sbpflow-demo-loss.png",
                   help="where to save the loss plot (PNG); '' for none")
    p.add_argument("--steps", type=int, default=None,
                   help="stop training after this many steps if --seconds has not run out")
    p.add_argument("--no-boxing", action="store_true", help="skip the boxing section")
    p.add_argument("--pipeline-steps", type=int, default=10,
                   help="1F1B steps of the pipeline section (default 10; 0 skips it)")
    p.add_argument("--timeline", default="sbpflow-demo-timeline.png",
                   help="where to save the pipeline's timeline (PNG); '' for none")
    return p


def main(argv=None) -> None:
    """``argv``: a list of arguments, an argparse namespace (from the ``sbpflow`` command) or
    None (``sys.argv``)."""
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        args = add_arguments(argparse.ArgumentParser(prog="sbpflow demo")).parse_args(argv)
    t0 = time.perf_counter()
    ok = True if args.no_boxing else boxing_section()
    results = _comm.launch(train_gpt, 4, args=(args.seconds, args.steps or 10**9))
    _report(results, args.plot or None)
    if args.pipeline_steps > 0:
        piped = _comm.launch(pipeline_gpt, 4, args=(args.pipeline_steps, args.timeline or None))
        _report_pipeline(piped[0])
    print(f"\ndemo done in {time.perf_counter() - t0:.0f} s")
    if not ok:
        raise SystemExit("demo: a boxing changed the value or moved unplanned bytes")


if __name__ == "__main__":
    main()
