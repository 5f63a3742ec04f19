"""DSpark drafter for Gemma4-12B at DeepSpec's settings (configs/gemma4.py).
`python -m dspark_jax.train --config configs/gemma4_12b_dspark.py
--config.target=/path/to/gemma-4-12B-it --config.data.prompts="('train.jsonl',)"`."""

from configs.gemma4 import gemma4_12b_config


def get_config():
    return gemma4_12b_config("gemma4_12b_dspark", "dspark")
