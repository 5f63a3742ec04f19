"""Eagle3 baseline on SmolLM2-135M-Instruct (SPEC §5): one draft layer over the same target
features, training-time test of length 7, soft CE with step decay 0.8, same data as the DSpark job."""

from configs import smollm2_dspark


def get_config():
    c = smollm2_dspark.get_config()
    c.name = "smollm2_eagle3"
    c.draft.model_type = "eagle3"
    c.draft.draft_num_hidden_layers = 1
    c.draft.ttt_length = 7
    c.draft.step_loss_decay = 0.8
    c.draft.markov_rank = 0
    c.draft.enable_confidence_head = False
    c.train.init_from_target = False    # Eagle3's fused first layer has no target counterpart
    return c
