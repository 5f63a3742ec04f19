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


# ----------------------------------------------------------------------------- Gemma4
GEMMA4_VARIANTS = {
    # every feature at once: 3 periods of sliding/full K/V owners + 2 KV-shared layers, window
    # 5 < test sequence, proportional RoPE (¼ rotated) on full layers with their own head dim
    # and k=v attention, per-layer inputs, double-wide MLP on shared layers, softcap, tied head
    "all_features": dict(
        num_hidden_layers=8, layer_types=["sliding_attention", "full_attention"] * 4,
        sliding_window=5, head_dim=8, global_head_dim=16, num_key_value_heads=2,
        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=4,
        num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=3.0,
        tie_word_embeddings=True),
    # plain: untied head, separate v_proj on full layers, half-rotated RoPE, no PLE/sharing/cap
    "untied_plain": dict(
        num_hidden_layers=4, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=3, head_dim=8, global_head_dim=16, num_key_value_heads=2,
        attention_k_eq_v=False, hidden_size_per_layer_input=0, tie_word_embeddings=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                               "rope_theta": 1_000_000.0}}),
}


def tiny_gemma4_config(variant: str, vocab: int = 97, **overrides):
    kw = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=32,
              intermediate_size=64, num_attention_heads=4, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    kw.update(GEMMA4_VARIANTS[variant])
    kw.update(overrides)
    return transformers.Gemma4TextConfig(**kw)


def build_tiny_gemma4(variant: str, seed: int = 0, **overrides):
    """A random Gemma4ForCausalLM (fp32, eval) with visibly non-trivial norms and scalars."""
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(tiny_gemma4_config(variant, **overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 2:  # larger than the 0.02 default so layers visibly matter
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model


def save_tiny_gemma4(path: pathlib.Path, variant: str, seed: int = 0, **overrides) -> pathlib.Path:
    build_tiny_gemma4(variant, seed, **overrides).save_pretrained(path, safe_serialization=True)
    return path


# Gemma4's special tokens at their real ids (google/gemma-4-*-it tokenizer.json); a tiny
# character vocabulary fills the other ids 0..106, so a vocab-128 tiny model can use it.
GEMMA4_SPECIAL_IDS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4,
                      "<|tool_response>": 50, "<|think|>": 98, "<|channel>": 100,
                      "<channel|>": 101, "<|turn>": 105, "<turn|>": 106}
# what Gemma4 checkpoints ship in generation_config.json: <eos>, <turn|>, <|tool_response>
GEMMA4_GENERATION_EOS = [1, 106, 50]


def gemma4_chat_template(preseed_thought_channel: bool) -> str:
    """Gemma4's chat format (bos, `<|turn>role\n…<turn|>\n`, assistant role "model", contents
    trimmed, a leading system turn). `preseed_thought_channel`: the generation prompt ends with
    the empty thought channel unless `enable_thinking` (the 31B/26B templates) or not (E2B's)."""
    seed = ("{% if not enable_thinking | default(false) %}<|channel>thought\n<channel|>{% endif %}"
            if preseed_thought_channel else "")
    return ("{{ bos_token }}"
            "{% if messages[0]['role'] == 'system' %}<|turn>system\n"
            "{{ messages[0]['content'] | trim }}<turn|>\n{% set loop = messages[1:] %}"
            "{% else %}{% set loop = messages %}{% endif %}"
            "{% for m in loop %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
            "{{ m['content'] | trim }}<turn|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|turn>model\n" + seed + "{% endif %}")


def save_tiny_gemma4_tokenizer(path: pathlib.Path, *, preseed_thought_channel: bool = True,
                               generation_eos: list[int] | None = GEMMA4_GENERATION_EOS
                               ) -> pathlib.Path:
    """tokenizer.json (+ generation_config.json with `generation_eos` unless None) of a
    character-level tokenizer with Gemma4's special tokens, ids and chat format."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = iter([chr(i) for i in range(32, 127)] + ["\n"])
    by_id = {i: t for t, i in GEMMA4_SPECIAL_IDS.items()}
    n = len(GEMMA4_SPECIAL_IDS) + 96
    vocab = {(by_id[i] if i in by_id else next(chars)): i for i in range(n)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(GEMMA4_SPECIAL_IDS))
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", mask_token="<mask>",
        chat_template=gemma4_chat_template(preseed_thought_channel),
        clean_up_tokenization_spaces=False)
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(path)
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 2, "eos_token_id": generation_eos, "pad_token_id": 0}))
    return path
