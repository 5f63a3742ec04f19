"""Eagle3 baseline (one draft layer, TTT 7) for Qwen3-4B (36 layers) at DeepSpec's settings
(config/eagle3/eagle3_qwen3_4b.py; see configs/qwen3.py). `python -m dspark_jax.train
--config configs/qwen3_4b_eagle3.py --config.target=/path/to/Qwen3-4B --config.data.prompts="('train.jsonl',)"`."""

from configs.qwen3 import qwen3_config


def get_config():
    return qwen3_config("4b", "eagle3")
