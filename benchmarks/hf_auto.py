"""`sf.auto.parallelize` on the tiny Hugging Face models of ``tests/hf/hf_zoo.py``: per family,
the traced layers, the search's seconds with parallelize's defaults (``algorithm="exhaustive"``)
and with ``algorithm="cd"``, the predicted step time of each, and (``--tables``) the strategy
found. 4 rank threads, a 1-D placement, the default cluster (one ``dgx-a100`` node of 4).
``--big``: instead, `sf.auto.trace` (on shapes, training mode) and `sf.auto.search` (one stage)
of GPT-2 small (12 x 768, 124 M parameters) and a Llama of 12 x 768 (12 / 4 heads, vocabulary
32000) on 8 x 512 tokens for one ``dgx-a100`` node of 8, in this process (float32, built real).

    .venv/bin/python benchmarks/hf_auto.py [--families gpt2 llama] [--tables] [--big]
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


def _big() -> None:
    import torch
    import transformers
    configs = {"gpt2-124m": transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12),
               "llama-12x768": transformers.LlamaConfig(
                   num_hidden_layers=12, hidden_size=768, intermediate_size=2048,
                   num_attention_heads=12, num_key_value_heads=4, vocab_size=32000)}
    cluster = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=8)
    ids = torch.randint(0, 1000, (8, 512), generator=torch.Generator().manual_seed(0))
    print(f"{'model':<14}{'layers':>7}{'trace s':>9}{'search s':>10}{'cd s':>7}{'step ms':>9}")
    for name, config in configs.items():
        m = sf.nn.from_torch(transformers.AutoModelForCausalLM.from_config(config))
        t0 = time.perf_counter()
        graph, _ = sf.auto.trace(m, {"input_ids": ids, "labels": ids})
        traced = time.perf_counter() - t0
        row = []
        for algorithm in ("exhaustive", "cd"):
            t0 = time.perf_counter()
            r = sf.auto.search(graph, cluster, algorithm, stages=1)
            row.append((time.perf_counter() - t0, r.breakdown.time))
        print(f"{name:<14}{len(graph.layers):>7}{traced:>9.2f}{row[0][0]:>10.2f}"
              f"{row[1][0]:>7.2f}{row[0][1] * 1e3:>9.2f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=list(hf_zoo.ZOO))
    ap.add_argument("--tables", action="store_true", help="print each strategy found")
    ap.add_argument("--big", action="store_true", help="GPT-2 small and a Llama of its size")
    args = ap.parse_args(argv)
    if args.big:
        return _big()
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
