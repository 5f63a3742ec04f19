"""The Llama / Qwen3 family (SPEC §2 targets; DeepSpec's Qwen3 drafter layers, SPEC §3, §5).

One pre-norm decoder layer (RMSNorm → GQA attention with RoPE → residual → RMSNorm →
SwiGLU → residual); Qwen3 adds a per-head RMSNorm on q and k. `config` reads and writes their
`config.json`, `decoder` runs the stacked layers, `hf_tensors` maps their Hugging Face tensors.
models/families.py registers them as the "llama" and "qwen3" families.
"""
