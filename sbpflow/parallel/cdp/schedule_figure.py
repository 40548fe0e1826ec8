"""The executed CDP schedule drawn as the paper's figure: a row a worker (one rank runs them
all) or a rank, a column a time step, each F / B op a box coloured by stage and labelled with
it (and the worker, on rows that serve several), hatched when it used the previous cycle's
version, and a red mark where a stage's update fired. Drawn from the records of the ops that
ran, never from a model of the schedule. See docs/cdp.md, 'Stats'.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .schedule_stats import Record

__all__ = ["draw_timeline", "Drawn"]


class Drawn(NamedTuple):
    """What a timeline picture holds, read back from the figure: the box labels ("F1",
    "B3\nw2", ...) in drawing order, how many boxes are hatched, the update marks, the rows."""

    labels: list[str]
    hatched: int
    updates: int
    rows: list[str]


def draw_timeline(records: Sequence[Record], path: str, rows_by: str, title: str,
                  steps: tuple[int, int]) -> Drawn:
    """Draw ``records`` with steps in ``[steps[0], steps[1])``; ``rows_by`` "worker" or
    "rank". Returns what the figure holds."""
    from matplotlib.figure import Figure  # not pyplot: no display, the caller's backend kept
    from matplotlib.patches import Patch, Rectangle

    lo, hi = steps
    shown = [r for r in records if lo <= r.step < hi]
    ops = [r for r in shown if r.kind in "FB"]
    rows = sorted({getattr(r, rows_by) for r in ops})
    row = {k: i for i, k in enumerate(rows)}
    cell: dict[tuple, list[Record]] = {}
    for r in sorted(ops, key=lambda r: (r.step, r.worker)):
        cell.setdefault((row[getattr(r, rows_by)], r.step), []).append(r)
    n = 1 + max((r.stage for r in ops), default=0)
    colours = [f"C{j % 10}" for j in range(n)]
    fig = Figure(figsize=(max(6.0, 0.42 * (hi - lo) + 1.5), 0.55 * len(rows) + 1.8), dpi=110)
    ax = fig.subplots()
    for (y, k), rs in cell.items():
        h = 0.9 / len(rs)
        for m, r in enumerate(rs):
            top = y - 0.45 + m * h
            ax.add_patch(Rectangle((k, top), 1, h, facecolor=colours[r.stage], alpha=0.85,
                                   hatch="///" if r.version < r.cycle else None,
                                   edgecolor="white", linewidth=0.6))
            label = f"{r.kind}{r.stage + 1}" + ("" if rows_by == "worker" else
                                                f"\nw{r.worker + 1}")
            ax.text(k + 0.5, top + h / 2, label, ha="center", va="center",
                    fontsize=6 if len(rs) > 1 or rows_by != "worker" else 7, color="black")
    for r in shown:
        if r.kind == "U" and (rows_by == "rank" or not rows):
            y = row.get(r.rank)
            if y is not None:
                ax.plot([r.step + 1], [y + 0.47], marker="v", color="red", markersize=4)
    ax.set_xlim(lo, hi)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [f"{rows_by} {k + 1 if rows_by == 'worker' else k}"
                                     for k in rows])
    ax.set_xlabel("time step")
    handles = [Patch(color=colours[j], label=f"stage {j + 1}") for j in range(n)]
    handles.append(Patch(facecolor="white", edgecolor="grey", hatch="///",
                         label="previous version (θ_{c-1})"))
    ax.legend(handles=handles, ncol=min(len(handles), 6), loc="upper center",
              bbox_to_anchor=(0.5, -0.18 if len(rows) > 2 else -0.3), fontsize=7,
              frameon=False)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    return Drawn([t.get_text() for t in ax.texts], sum(1 for p in boxes if p.get_hatch()),
                 len(ax.lines), [t.get_text() for t in ax.get_yticklabels()])
