"""Tiny Hugging Face transformers models built from their configs (no download), one a family:
decoder-only with learned positions (GPT2, OPT), rotary with grouped-query attention (Llama,
Qwen2), rotary with a parallel residual (GPT-NeoX, Phi), and an encoder with a masked-LM head
(BERT). `build(name)` gives the float64 model, seeded, in eval mode (no dropout draws);
`token_ids` a batch from its own generator (the rank threads share torch's global RNG)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)
_DECODER = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=16,
                intermediate_size=32, max_position_embeddings=32)

# family: (config class, model class, config arguments)
ZOO = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_layer=2, n_head=2, n_embd=16, n_positions=32)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_DECODER, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_DECODER, num_key_value_heads=2)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_DECODER, use_parallel_residual=True)),
    "phi": ("PhiConfig", "PhiForCausalLM", _DECODER),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=16, ffn_dim=32,
                 max_position_embeddings=32, word_embed_proj_dim=16)),
    "bert": ("BertConfig", "BertForMaskedLM", _DECODER),
}
CAUSAL = [name for name in ZOO if name != "bert"]


def config(name: str, **overrides):
    config_cls, _, kwargs = ZOO[name]
    return getattr(transformers, config_cls)(**{**_COMMON, **kwargs, **overrides})


def build(name: str, seed: int = 0, dtype=torch.float64, **overrides):
    """The family's tiny model, its weights drawn from ``seed``, in ``dtype``, in eval mode."""
    torch.manual_seed(seed)
    model = getattr(transformers, ZOO[name][1])(config(name, **overrides)).to(dtype)
    return model.eval()


def token_ids(batch: int = 4, seq: int = 8, seed: int = 1) -> torch.Tensor:
    """Token ids in [3, VOCAB) (clear of the bos / eos / pad ids), from their own generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def trained(loss_of, opt, steps: int) -> list[float]:
    """``steps`` optimizer steps of the loss ``loss_of()`` gives (backward, step, zero_grad);
    the loss of each step, as Python floats. For torch and sbpflow models alike."""
    losses = []
    for _ in range(steps):
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
