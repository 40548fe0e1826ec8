"""Drawing the runtime's firings: a Chrome trace, a Gantt chart, micro-batches in flight.

An event is ``{"rank", "actor", "kind", "stage", "micro_batch", "start", "end"}`` (seconds on
one clock for all ranks). `save_trace` writes the Chrome trace JSON that Perfetto and
chrome://tracing open (a process a rank; a thread its kernels, one each other actor);
`save_timeline` draws a PNG with matplotlib (a row a rank, forward and backward in two
colours, micro-batch numbers on the bars); `in_flight` reads, per stage, the most forward
micro-batches whose backward had not ended. See docs/runtime.md, 'Schedules as register
budgets'.
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

from .specs import QUEUES

__all__ = ["save_trace", "save_timeline", "in_flight", "COLOURS"]

COLOURS = {"forward": "#4C78A8", "backward": "#F58518", "send": "#54A24B", "recv": "#A6D49F",
           "collective": "#B279A2", "load": "#9D755D", "update": "#E45756",
           "compute": "#72B7B2"}
# kinds drawn on a thin strip under their rank's row: they run on their own threads, and a
# recv's bar spans its whole wait, which would hide the kernels it overlaps
_STRIP = frozenset({"send", "recv", "load", "collective"})


def _origin(events: Sequence[dict]) -> float:
    return min((e["start"] for e in events), default=0.0)


def _overlap(spans: list[tuple[float, float]], more: list[tuple[float, float]]) -> bool:
    """Whether an interval of ``more`` overlaps one of ``spans`` (each list's own do not)."""
    end = float("-inf")
    for start, stop in sorted(spans + more):
        if start < end:
            return True
        end = max(end, stop)
    return False


def _threads(events: Sequence[dict]) -> dict[tuple[int, str], tuple[int, str]]:
    """``(rank, actor) -> (tid, thread name)`` of the trace. The kernels (kinds of the compute
    queue) share the rank's ``compute`` thread, as they do in the runtime, unless an actor's
    firings overlap it (its plan gave it a queue of its own): then it has its own thread. Every
    other actor has a thread of its own, named after it: a graph runs each transfer on its own
    queue, and on one thread slices that overlap without nesting are drawn mis-nested."""
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    kinds: dict[tuple[int, str], str] = {}
    for e in events:
        key = (e["rank"], e["actor"])
        spans.setdefault(key, []).append((e["start"], e["end"]))
        kinds[key] = QUEUES.get(e["kind"], "compute")
    rows = {}
    for r in sorted({rank for rank, _ in spans}):
        mine = [k for k in spans if k[0] == r]
        kernels = sorted((k for k in mine if kinds[k] == "compute"), key=lambda k: min(spans[k]))
        shared: list[tuple[float, float]] = []
        alone = []
        for k in kernels:  # the first always joins: the compute thread is tid 0
            if _overlap(shared, spans[k]):
                alone.append(k)
            else:
                shared += spans[k]
                rows[k] = (0, "compute")
        others = sorted((k for k in mine if kinds[k] != "compute"), key=lambda k: (kinds[k], k))
        for tid, k in enumerate(alone + others, start=1 if kernels else 0):
            rows[k] = (tid, k[1])
    return rows


def save_trace(events: Iterable[dict], path: str) -> None:
    """Write ``events`` as a Chrome trace (JSON object format; times in µs from the first
    start): one process a rank; in it one thread the kernels (``compute``) and one each other
    actor (a transfer, collective or load, named after it), so that no two slices of a thread
    overlap (see `_threads`)."""
    events = list(events)
    t0 = _origin(events)
    rows = _threads(events)
    out = []
    for r in sorted({e["rank"] for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        for tid, name in sorted({v for (rank, _), v in rows.items() if rank == r}):
            out += [{"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                     "args": {"name": name}},
                    {"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid,
                     "args": {"sort_index": tid}}]
    for e in events:
        out.append({"name": f"{e['actor']} #{e['micro_batch']}", "cat": e["kind"], "ph": "X",
                    "ts": (e["start"] - t0) * 1e6, "dur": (e["end"] - e["start"]) * 1e6,
                    "pid": e["rank"], "tid": rows[e["rank"], e["actor"]][0],
                    "args": {"stage": e["stage"], "micro_batch": e["micro_batch"]}})
    with open(path, "w") as f:
        json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)


def save_timeline(events: Iterable[dict], path: str, title: str | None = None) -> None:
    """Draw ``events`` as a Gantt chart PNG: a row a rank (rank 0 on top), a bar a firing
    coloured by kind, labelled with its micro-batch when the bar is wide enough; transfers and
    loads on a thin strip under the row."""
    from matplotlib.figure import Figure  # not pyplot: no display, the caller's backend kept
    from matplotlib.patches import Patch

    events = list(events)
    t0 = _origin(events)
    ranks = sorted({e["rank"] for e in events})
    row = {r: i for i, r in enumerate(ranks)}
    span = max((e["end"] for e in events), default=t0) - t0 or 1.0
    fig = Figure(figsize=(12, 0.6 * len(ranks) + 1.6), dpi=120)
    ax = fig.subplots()
    for e in events:
        x, w = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
        strip = e["kind"] in _STRIP
        y = row[e["rank"]] + (0.33 if strip else -0.1)
        ax.barh(y, w, left=x, height=0.2 if strip else 0.6,
                color=COLOURS.get(e["kind"], "#999"), edgecolor="white", linewidth=0.5)
        if not strip and w > span * 1e3 / 120:  # room for a label
            ax.text(x + w / 2, y, str(e["micro_batch"]), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    kinds = [k for k in COLOURS if any(e["kind"] == k for e in events)]
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], ncol=len(kinds),
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(ranks) < 3 else -0.12),
              fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)


def in_flight(events: Iterable[dict]) -> dict[int, int]:
    """Per stage, the most micro-batches at once whose forward had started and whose
    backward had not ended (read from the ``"forward"`` / ``"backward"`` events)."""
    marks: dict[int, list[tuple[float, int]]] = {}
    for e in events:
        if e["kind"] == "forward":
            marks.setdefault(e["stage"], []).append((e["start"], 1))
        elif e["kind"] == "backward":
            marks.setdefault(e["stage"], []).append((e["end"], -1))
    peak = {}
    for stage, ms in marks.items():
        n = best = 0
        for _, d in sorted(ms):  # at equal times an end (-1) counts before a start
            n += d
            best = max(best, n)
        peak[stage] = best
    return peak
