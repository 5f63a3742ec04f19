"""Tiny random Hugging Face checkpoints that tests save to temp dirs (no downloads)."""

from __future__ import annotations

import pathlib

import torch
import transformers


def tiny_hf_config(family: str, *, tie: bool = False, head_dim: int | None = None,
                   vocab: int = 97, layers: int = 3, rope_scaling: dict | None = None):
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim or 8, rope_theta=1e6, **common)
    kw = dict(rope_theta=1e5)
    if rope_scaling:
        kw["rope_scaling"] = rope_scaling
    return transformers.LlamaConfig(head_dim=head_dim or 8, **kw, **common)


def save_tiny_hf(path: pathlib.Path, family: str, seed: int = 0, **kw) -> pathlib.Path:
    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    # non-trivial norm weights so a dropped norm cannot pass the parity test
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(path: pathlib.Path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
