"""DSpark drafter for Qwen3-14B (40 layers; DeepSpec layer ids (1, 10, 19, 28, 37)) with the paper's settings
(see configs/qwen3.py). `python -m dspark_jax.train --config configs/qwen3_14b_dspark.py
--config.target=/path/to/Qwen3-14B --config.data.prompts="('train.jsonl',)"`."""

from configs.qwen3 import qwen3_dspark_config


def get_config():
    return qwen3_dspark_config("qwen3_14b_dspark", (1, 10, 19, 28, 37))
