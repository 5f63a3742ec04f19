"""DSpark drafter for Qwen3-4B (36 layers; DeepSpec layer ids (1, 9, 17, 25, 33)) with the paper's settings
(see configs/qwen3.py). `python -m dspark_jax.train --config configs/qwen3_4b_dspark.py
--config.target=/path/to/Qwen3-4B --config.data.prompts="('train.jsonl',)"`."""

from configs.qwen3 import qwen3_dspark_config


def get_config():
    return qwen3_dspark_config("qwen3_4b_dspark", (1, 9, 17, 25, 33))
