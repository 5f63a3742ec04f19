"""DFlash baseline on SmolLM2-135M-Instruct: the DSpark job's backbone without the sequential
(Markov) and confidence heads, trained with cross-entropy only (DeepSpec's DFlash recipe)."""

from configs import smollm2_dspark


def get_config():
    c = smollm2_dspark.get_config()
    c.name = "smollm2_dflash"
    c.draft.model_type = "dflash"
    c.draft.markov_rank = 0
    c.draft.enable_confidence_head = False
    return c
