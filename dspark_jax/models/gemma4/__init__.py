"""The Gemma4 family (SPEC §2 target; the paper's cross-family Gemma4-12B result).

`config` reads and writes its `config.json`, `decoder` runs its layers inside the target decoder
(sliding/full attention, k=v layers, per-layer inputs, KV sharing), `hf_tensors` maps its
Hugging Face tensors, and `drafters` builds DeepSpec's Gemma4 DSpark/DFlash/Eagle3 drafters.
models/families.py registers them as the "gemma4" family.
"""
