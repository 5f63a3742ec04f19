"""Data stage of the pipeline (prompts → chat rendering/loss masks → regeneration → features).

`prompts` reads prompt and conversation sources (DeepSpec evaluation files, training
conversation JSONL, HumanEval) and splits held-out data; `chat` renders conversations with the
target's chat template into token ids plus the assistant loss mask of DeepSpec training (SPEC §4).
"""
