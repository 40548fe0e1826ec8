"""`sf.auto.parallelize` on the tiny Hugging Face models of ``tests/hf/hf_zoo.py``: per family,
the traced layers, the search's seconds with parallelize's defaults (``algorithm="exhaustive"``)
and with ``algorithm="cd"``, the predicted step time of each, and (``--tables``) the strategy
found. 4 rank threads, a 1-D placement, the default cluster (one ``dgx-a100`` node of 4).

    .venv/bin/python benchmarks/hf_auto.py [--families gpt2 llama] [--tables]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import sbpflow as sf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "hf"))
import hf_zoo  # noqa: E402


def _run(model, ids, options: dict) -> tuple:
    pl = sf.placement("cpu", [0, 1, 2, 3])
    example = {"input_ids": sf.tensor(ids, pl), "labels": sf.tensor(ids, pl)}
    t0 = time.perf_counter()
    plan = sf.auto.parallelize(model, example, pl, **options)
    return (time.perf_counter() - t0, plan.search_seconds, plan.breakdown.time,
            len(plan.graph.layers), plan.notes, str(plan))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=list(hf_zoo.ZOO))
    ap.add_argument("--tables", action="store_true", help="print each strategy found")
    args = ap.parse_args(argv)
    print(f"{'family':<10}{'layers':>7}{'search s':>10}{'cd s':>8}{'step us':>9}"
          f"{'cd step us':>11}  traced")
    for name in args.families:
        model, ids = hf_zoo.build(name), hf_zoo.token_ids()
        runs = [sf.launch(_run, world_size=4, args=(model, ids, o))[0]
                for o in ({}, {"algorithm": "cd"})]
        (_, s0, t0, n, notes, table), (_, s1, t1, *_) = runs
        how = "real forward" if any("real forward" in x for x in notes) else "on shapes"
        print(f"{name:<10}{n:>7}{s0:>10.2f}{s1:>8.2f}{t0 * 1e6:>9.1f}{t1 * 1e6:>11.1f}  {how}")
        if args.tables:
            print(table)


if __name__ == "__main__":
    main()
