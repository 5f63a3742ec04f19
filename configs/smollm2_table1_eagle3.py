"""Small-scale Table 1 on SmolLM2-135M-Instruct, Eagle3 row: one draft layer, training-time
test of length 7, step loss decay 0.8; the same prompts, regenerated data, steps and batch as
the other rows (see configs/smollm2_table1_dspark.py)."""

from configs.smollm2_table1_dspark import table1_config


def get_config():
    return table1_config("eagle3")
