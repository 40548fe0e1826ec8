"""Hugging Face models' training step: sbpflow vs PyTorch's own equivalents, side by side on
gloo processes (issue 36's figures). The models are built from their configs (no download),
float32, and trained by their own ``labels=`` loss with AdamW (the fused kernel on both sides):

* ``dp``: GPT-2, sbpflow data parallel (``{"*": sf.B}``, token ids ``S(0)``) vs
  ``DistributedDataParallel``;
* ``tp``: Llama, sbpflow by the model's own plan (``sf.parallel.hf_tp_plan``) on all ranks vs
  DTensor's ``parallelize_module`` with the same plan written as ``ColwiseParallel`` /
  ``RowwiseParallel``;
* ``2d``: Llama on a 2 x (n/2) mesh, data parallel x tensor parallel with ZeRO-3 on the data
  dim (``hf_tp_plan(model, dp_dim=0)``, ``zero=3``) vs FSDP2 ``fully_shard`` over DTensor TP.

Prints each median step (ms) and the ratio; the steps take turns (``timing.take_turns``).

    python benchmarks/hf_step.py [--steps 10] [-n 4] [--width 128] [--layers 2] [--seq 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist
import transformers

import sbpflow as sf
from timing import take_turns


def _gpt2(cfg):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=cfg["layers"], n_head=cfg["heads"], n_embd=cfg["width"],
        vocab_size=cfg["vocab"], n_positions=cfg["seq"], bos_token_id=0, eos_token_id=0))


def _llama(cfg):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["heads"], hidden_size=cfg["width"],
        intermediate_size=4 * cfg["width"], vocab_size=cfg["vocab"],
        max_position_embeddings=cfg["seq"], bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _ids(cfg) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)


def _step(model, opt, **inputs):
    def step():
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def _sf_step(cfg, make, mesh, rules, sbp, zero=0):
    model = sf.parallel.apply(make(cfg), mesh, rules, zero=zero)
    ids = sf.tensor(_ids(cfg), mesh, sbp)
    return _step(model, sf.optim.AdamW(model.parameters(), lr=1e-4), input_ids=ids, labels=ids)


def _ddp_step(cfg):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_gpt2(cfg).train())
    r, n = dist.get_rank(), dist.get_world_size()
    b = cfg["batch"] // n
    ids = _ids(cfg)[r * b:(r + 1) * b]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    return _step(model, opt, input_ids=ids, labels=ids)


def _dtensor_plan(model) -> dict:
    """Llama's own plan (``model._tp_plan``) as DTensor styles, the lm_head and embedding
    replicated (as the sbpflow rows' losses read split logits, DTensor's reads whole ones)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def _dtensor_step(cfg, two_d: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    n = dist.get_world_size()
    model = _llama(cfg).train()
    ids = _ids(cfg)
    if not two_d:
        parallelize_module(model, init_device_mesh("cpu", (n,)), _dtensor_plan(model))
    else:
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], _dtensor_plan(model))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        b = cfg["batch"] // 2
        r = mesh.get_coordinate()[0]
        ids = ids[r * b:(r + 1) * b]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    return _step(model, opt, input_ids=ids, labels=ids)


def _bench(cfg, steps: int) -> list:
    n = dist.get_world_size()
    flat = sf.placement("cpu", list(range(n)))
    mesh = sf.placement("cpu", [list(range(n // 2)), list(range(n // 2, n))])
    llama = _llama(cfg)
    cases = [
        ("dp", "GPT-2", "DDP", lambda: _sf_step(cfg, lambda c: _gpt2(c).train(), flat,
                                                 {"*": sf.B}, sf.S(0)),
         lambda: _ddp_step(cfg)),
        ("tp", "Llama", "DTensor TP", lambda: _sf_step(cfg, lambda c: _llama(c).train(), flat,
                                                        sf.parallel.hf_tp_plan(llama), sf.B),
         lambda: _dtensor_step(cfg, False)),
        ("2d zero3", "Llama", "FSDP2 + TP", lambda: _sf_step(
            cfg, lambda c: _llama(c).train(), mesh, sf.parallel.hf_tp_plan(llama, dp_dim=0),
            (sf.S(0), sf.B), zero=3), lambda: _dtensor_step(cfg, True)),
    ]
    rows = []
    for layout, model, ref, make_sf, make_ref in cases:
        t_sf, t_ref = (statistics.median(ts) for ts in take_turns([make_sf(), make_ref()],
                                                                    steps))
        rows.append((layout, model, ref, t_sf, t_ref))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("-n", "--ranks", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args(argv)
    if args.ranks % 2 or args.batch % args.ranks or args.heads % args.ranks:
        ap.error(f"-n {args.ranks}: an even number that divides the batch ({args.batch}) and "
                 f"the heads ({args.heads})")
    cfg = dict(width=args.width, layers=args.layers, heads=args.heads, batch=args.batch,
               seq=args.seq, vocab=args.vocab)
    print(f"width={args.width} layers={args.layers} heads={args.heads} batch={args.batch} "
          f"seq={args.seq} vocab={args.vocab}, float32; {args.ranks} gloo processes; median "
          f"of {args.steps} steps, sbpflow and torch taking turns")
    rows = sf.launch(_bench, world_size=args.ranks, backend="torch",
                     args=(cfg, args.steps))[0]
    print(f"{'layout':<10}{'model':<7}{'vs':<12}{'sbpflow ms':>11}{'torch ms':>10}{'ratio':>7}")
    for layout, model, ref, t_sf, t_ref in rows:
        print(f"{layout:<10}{model:<7}{ref:<12}{t_sf * 1e3:>11.1f}{t_ref * 1e3:>10.1f}"
              f"{t_sf / t_ref:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
