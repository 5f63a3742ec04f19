"""Eagle3 baseline (one draft layer, TTT 7) for Qwen3-14B (40 layers) at DeepSpec's settings
(config/eagle3/eagle3_qwen3_14b.py; see configs/qwen3.py). `python -m dspark_jax.train
--config configs/qwen3_14b_eagle3.py --config.target=/path/to/Qwen3-14B --config.data.prompts="('train.jsonl',)"`."""

from configs.qwen3 import qwen3_config


def get_config():
    return qwen3_config("14b", "eagle3")
