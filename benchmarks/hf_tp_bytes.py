"""Bytes a training step of tensor parallelism by a transformers model's own plan moves
(`sf.parallel.hf_tp_plan`), against Megatron's formula (tests/hf/test_hf_tp_plan.py derives it
and checks it exactly), and the README's Megatron rules copied onto GPT-2 with ``nn.Linear``'s
axes (HF ``Conv1D`` stores its weight transposed) against the plan. Tiny hf_zoo models, batch
4 x 8, one SGD step on 1-D meshes of thread ranks; rank 0's sent bytes. GPT-2's fused
``c_attn`` ([q | k | v]) adds the all-to-alls of its cut (``+ qkv cut``). In float64, Llama's
RMSNorm casts the partial residual to float32 before its reduction: fewer bytes than Megatron.

    python benchmarks/hf_tp_bytes.py [--tp 2 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "hf"))
import hf_zoo  # noqa: E402
from test_hf_tp_plan import megatron_bytes  # noqa: E402  (the formula the test checks)

import sbpflow as sf  # noqa: E402

README_RULES = {"*.attn.c_attn.*": sf.S(0), "*.attn.c_proj.weight": sf.S(1),
                "*.mlp.c_fc.*": sf.S(0), "*.mlp.c_proj.weight": sf.S(1), "*": sf.B}


def _step(model, ids, t, rules):
    pl = sf.placement("cpu", list(range(t)))
    m = sf.parallel.apply(model, pl, rules)
    opt = sf.optim.SGD(m.parameters(), lr=0.1)
    x = sf.tensor(ids, pl, sf.B)
    replicated = sum(p.numel() for p in m.parameters() if all(s == sf.B for s in p.sbp))
    sf.comm.reset_stats()
    m(input_ids=x, labels=x).loss.backward()
    opt.step()
    return sf.comm.stats().sent, replicated


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    ids = hf_zoo.token_ids()
    print(f"{'model':8} {'tp':>2} {'dtype':8} {'sbpflow':>8} {'Megatron':>8} {'+ qkv cut':>9}")
    for name in ("llama", "gpt2"):
        for t in args.tp:
            for dtype in (torch.float32, torch.float64):
                over = dict(num_key_value_heads=t) if name == "llama" and t > 2 else {}
                model = hf_zoo.build(name, dtype=dtype, **over)
                sent, rep = sf.launch(_step, world_size=t,
                                      args=(model, ids, t, sf.parallel.hf_tp_plan(model)))[0]
                c, size = model.config, torch.tensor([], dtype=dtype).element_size()
                cfg = dict(b=ids.shape[0], s=ids.shape[1], h=c.hidden_size,
                           layers=c.num_hidden_layers, replicated=rep, fused_qkv=False)
                plain = megatron_bytes(cfg, t, size)
                fused = megatron_bytes(dict(cfg, fused_qkv=name == "gpt2"), t, size) - plain
                print(f"{name:8} {t:2} {str(dtype)[6:]:8} {sent:8} {plain:8} {fused:9}")
    model = hf_zoo.build("gpt2", dtype=torch.float32)
    for t in args.tp:
        naive = sf.launch(_step, world_size=t, args=(model, ids, t, README_RULES))[0][0]
        plan = sf.launch(_step, world_size=t,
                         args=(model, ids, t, sf.parallel.hf_tp_plan(model)))[0][0]
        print(f"gpt2 tp {t}: README rules with Linear axes {naive} bytes, the plan {plan} "
              f"({naive / plan:.2f}x)")


if __name__ == "__main__":
    main()
