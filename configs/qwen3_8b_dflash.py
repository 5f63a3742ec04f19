"""DFlash baseline (no Markov / confidence head, CE only) for Qwen3-8B (36 layers) at DeepSpec's settings
(config/dflash/dflash_qwen3_8b.py; see configs/qwen3.py). `python -m dspark_jax.train
--config configs/qwen3_8b_dflash.py --config.target=/path/to/Qwen3-8B --config.data.prompts="('train.jsonl',)"`."""

from configs.qwen3 import qwen3_config


def get_config():
    return qwen3_config("8b", "dflash")
