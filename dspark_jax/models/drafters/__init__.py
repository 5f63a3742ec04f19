"""The drafters (SPEC §3–5): the DSpark / DFlash parallel block backbone (`dspark`, with its
block attention in `block_attention`), DSpark's sequential (Markov) and confidence heads
(`heads`), the Eagle3 baseline (`eagle3`), their configuration (`config.DraftConfig`) and the
public handle (`draft.Draft`, `init_draft`, `load_draft`). Gemma4's drafters subclass these in
models/gemma4/drafters.py.
"""
