"""Fine-tune a tiny Hugging Face transformers model (built from its config: no download) on the
generated corpus, in any layout, with the model's own ``labels=`` loss; then sample with
``model.generate`` and optionally export a checkpoint ``from_pretrained`` loads.

    python examples/hf_finetune.py                          # GPT-2, data parallel, 4 thread ranks
    python examples/hf_finetune.py --model llama --layout 2d    # dp x tp by Llama's own plan
    python examples/hf_finetune.py --layout zero3 --export out/ # then from_pretrained("out/")
    python examples/hf_finetune.py --layout pp               # 2 stages x 2-way data parallel, 1F1B
    python examples/hf_finetune.py --layout auto             # sf.auto.parallelize chooses
    sbpflow run -n 4 --backend torch examples/hf_finetune.py --layout tp    # gloo processes

Layouts (4 ranks): dp (weights B, batch S(0)); tp (the model's tensor-parallel plan,
`sf.parallel.hf_tp_plan`, on all ranks; batch B); 2d (2x2 mesh: data parallel x the plan);
zero3 (dp with ZeRO-3); pp (2 pipeline stages of 2 data-parallel ranks, graph mode 1F1B,
``--eager``: one stage after the other); auto (`sf.auto.parallelize` searches a strategy).
The corpus and its character tokenizer are sbpflow.models' (`char_corpus`, `CharData`); the
batches come from `sf.data.DataLoader`. docs/huggingface.md explains each step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `sbpflow run` runs us by path

import common  # noqa: E402
import sbpflow as sf  # noqa: E402
from sbpflow.models import CharData, char_corpus  # noqa: E402

LAYOUTS = ("dp", "tp", "2d", "zero3", "pp", "auto")
PROMPT = "the "
PIPELINE_SPLIT = {"gpt2": "transformer.h.{}", "llama": "model.layers.{}"}  # stage 1 starts here


def tiny_model(kind: str, data: CharData, args) -> torch.nn.Module:
    """A float32 transformers model from its config (``--d`` wide, ``--layers`` deep) for the
    corpus' characters, the newline its end of sequence, one more id its padding (never in
    the text); seeded. No dropout (GPT-2's default 0.1 would draw other masks in each
    layout: without it every layout gives the same losses)."""
    import transformers
    nl = data.index["\n"]
    common_ids = dict(vocab_size=data.vocab + 1, bos_token_id=nl, eos_token_id=nl,
                      pad_token_id=data.vocab)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=args.layers, n_head=args.heads, n_embd=args.d,
                                         n_positions=args.seq + args.sample, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common_ids)
    else:  # Llama: rotary positions, RMSNorm, SwiGLU, grouped-query attention (2 heads a KV head)
        config = transformers.LlamaConfig(
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.heads // 2, hidden_size=args.d, intermediate_size=2 * args.d,
            max_position_embeddings=args.seq + args.sample, **common_ids)
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(config)


class Windows(torch.utils.data.Dataset):
    """The corpus' token ids in consecutive windows of ``seq`` (a map-style dataset for
    `sf.data.DataLoader`; the model shifts the labels itself)."""

    def __init__(self, data: CharData, seq: int) -> None:
        self.ids, self.seq = data.data, seq

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i * self.seq:(i + 1) * self.seq]


class LabelsLoss(sf.nn.Module):
    """``lm(input_ids=ids, labels=ids).loss``: HF's own causal-LM loss, as the step's loss
    (`common.train` calls ``model(*inputs)``)."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, labels=ids).loss


def lay_out(torch_model, args, example: torch.Tensor):
    """The model laid out by ``args.layout`` on this world's ranks: (model to call, placement
    of the token ids, their nd-sbp, a description)."""
    world, name = sf.world_size(), args.layout
    flat = sf.placement("cpu", list(range(world)))
    if name in ("dp", "zero3"):
        zero = 3 if name == "zero3" else 0
        model = sf.parallel.apply(torch_model, flat, {"*": sf.B}, zero=zero)
        return model, flat, (sf.S(0),), f"{name}: weights {'ZeRO-3 S(0)' if zero else 'B'}, " \
                                        f"batch S(0) over {world} ranks"
    if name == "tp":
        model = sf.parallel.apply(torch_model, flat, sf.parallel.hf_tp_plan(torch_model))
        return model, flat, (sf.B,), f"tp: the model's own plan over {world} ranks, batch B"
    if name == "2d":
        if world % 2 or world < 4:
            raise SystemExit(f"layout 2d needs an even number of ranks >= 4, not {world}")
        mesh = sf.placement("cpu", [list(range(i, i + 2)) for i in range(0, world, 2)])
        model = sf.parallel.apply(torch_model, mesh, sf.parallel.hf_tp_plan(torch_model,
                                                                            dp_dim=0))
        return model, mesh, (sf.S(0), sf.B), f"2d: {world // 2}x2 mesh, data parallel x the " \
                                              f"model's own plan"
    if name == "pp":
        return _pipeline(torch_model, args, world)
    plan = sf.auto.parallelize(torch_model, {"input_ids": sf.tensor(example, flat, sf.S(0)),
                                             "labels": sf.tensor(example, flat, sf.S(0))}, flat)
    return plan.model, plan.placement, (sf.S(0),) + (sf.B,) * (plan.placement.ndim - 1), \
        f"auto: searched in {plan.search_seconds:.2f} s, stream mesh {tuple(plan.placement.shape)}"


def _pipeline(torch_model, args, world: int):
    """2 stages of ``world // 2`` data-parallel ranks, cut before the middle layer."""
    if world < 4 or world % 2:
        raise SystemExit(f"layout pp needs an even number of ranks >= 4, not {world}")
    half = world // 2
    stages = [sf.placement("cpu", list(range(half))), sf.placement("cpu", list(range(half, world)))]
    cut = PIPELINE_SPLIT[args.model].format(args.layers // 2)
    model = sf.nn.from_torch(torch_model, stages[0])
    sf.parallel.pipeline(model, stages, split=[cut], rules=[{"*": sf.B}] * 2)
    return model, stages[0], (sf.S(0),), f"pp: 2 stages of {half} data-parallel ranks, cut " \
                                         f"before {cut}"


def sample(model, where, *, data: CharData, prompt: str, n: int) -> str:
    """Greedy ``model.generate`` (KV cache on) of ``n`` characters after ``prompt``, on the
    ids' placement ``where`` (a torch model: plain torch)."""
    ids = data.encode(prompt)[None]
    mask = torch.ones_like(ids)
    if where is not None:
        bsbp = (sf.B,) * where.ndim
        ids, mask = sf.tensor(ids, where, bsbp), sf.tensor(mask, where, bsbp)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    out = out.full_tensor() if where is not None else out
    return data.decode([i for i in out[0].tolist() if i < data.vocab])   # the padding id out


def main(args):
    data, torch_model = args.data, args.torch_model
    model, where, sbp, described = lay_out(torch_model, args, data.batch(0)[0])
    loader = sf.data.DataLoader(Windows(data, args.seq), batch_size=args.batch, placement=where,
                                sbp=sbp, shuffle=True, seed=args.seed, workers=0)
    opt = sf.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    if common.on_rank0():
        n = sum(p.numel() for p in torch_model.parameters())
        print(f"{type(torch_model).__name__}: {n} parameters (d={args.d}, layers={args.layers}, "
              f"vocab={torch_model.config.vocab_size}), seq {args.seq}, batch {args.batch}; "
              f"{described}")
    res = common.train(LabelsLoss(model), opt, lambda step: (loader(),), args,
                       per_step=args.batch * args.seq, unit="tok",
                       desc=f"{args.model} {args.layout}")
    model.eval()
    if args.sample:
        text = sample(model, where, data=data, prompt=PROMPT, n=args.sample)
        if common.on_rank0():
            print(f"  sample: {text!r}")
    if args.export:
        export(model, args, data)
    return res


def export(model, args, data: CharData) -> None:
    """`sf.export` (every rank), then on rank 0 transformers' ``from_pretrained`` of the files
    and its own greedy sample (plain torch)."""
    sf.export(model, args.export)
    if not common.on_rank0():
        return
    import transformers
    loaded = transformers.AutoModelForCausalLM.from_pretrained(args.export)
    text = sample(loaded, None, data=data, prompt=PROMPT, n=args.sample) if args.sample else ""
    print(f"  exported to {args.export}: AutoModelForCausalLM.from_pretrained({args.export!r})"
          f" loads it{'; its sample: ' + repr(text) if text else ''}")


def arguments() -> argparse.ArgumentParser:
    p = common.parser(__doc__.splitlines()[0], layouts=LAYOUTS, layout_default="dp", steps=200,
                      batch=16, lr=3e-3)
    p.add_argument("--model", choices=sorted(PIPELINE_SPLIT), default="gpt2",
                   help="the transformers family (default gpt2)")
    p.add_argument("--d", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--seq", type=int, default=32, help="tokens a sample (default 32)")
    p.add_argument("--sample", type=int, default=40, help="characters to generate (default 40)")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="sf.export the model here (safetensors + config) after training")
    return p


def parse(argv=None):
    """The arguments, with the corpus (``args.data``) and the torch model
    (``args.torch_model``) made once here, before the ranks start: rank threads share torch's
    global generator, so a model built on each would draw different weights."""
    args = arguments().parse_args(argv)
    args.data = CharData(char_corpus(seed=args.seed), args.seq, args.batch, seed=args.seed)
    args.torch_model = tiny_model(args.model, args.data, args)
    return args


if __name__ == "__main__":
    common.run(main, parse())
