"""Small-scale Table 1 on SmolLM2-135M-Instruct, DFlash row: the DSpark row's backbone
(2 layers, block 7) without the Markov and confidence heads, CE only; the same prompts,
regenerated data, steps and batch as the other rows (see configs/smollm2_table1_dspark.py)."""

from configs.smollm2_table1_dspark import table1_config


def get_config():
    return table1_config("dflash")
