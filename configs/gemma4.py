"""DeepSpec's Gemma4-12B drafter settings (config/{dspark,dflash,eagle3}/*_gemma4_12b.py), shared
by gemma4_12b_{dspark,dflash,eagle3}.py: 5 draft layers (Eagle3: 1, TTT 7, step decay 0.8),
block 7, target layer ids (5, 17, 29, 41, 46), mask token 4, 512 anchors, AdamW lr 6e-4 with
4% warmup and no weight decay, global batch 512, 10 epochs, max_length 4096, bf16, gradient
clipping 1.0, a checkpoint every 3000 steps, seed 42 (Eagle3: 0); the "gemma4" chat format (data/chat.py: empty thought-channel prefix, no default system prompt).

`target` is a local Hugging Face directory of google/gemma-4-12B-it (its `text_config` is used;
vision/audio weights are skipped): `--config.target=/path/to/gemma-4-12B-it`.
"""

from dspark_jax.train.config_base import get_base_config

GEMMA4_MASK_TOKEN = 4
GEMMA4_12B_LAYER_IDS = (5, 17, 29, 41, 46)


def gemma4_12b_config(name: str, model_type: str):
    c = get_base_config()
    c.name = name
    c.target = ""                    # required: --config.target=/path/to/gemma-4-12B-it
    c.seed = 0 if model_type == "eagle3" else 42
    c.draft.model_type = model_type
    c.draft.num_draft_layers = 5
    c.draft.block_size = 7
    c.draft.target_layer_ids = GEMMA4_12B_LAYER_IDS
    c.draft.mask_token_id = GEMMA4_MASK_TOKEN
    c.draft.num_anchors = 512
    c.draft.loss_decay_gamma = 4.0
    if model_type == "eagle3":
        c.draft.draft_num_hidden_layers = 1
        c.draft.ttt_length = 7
        c.draft.step_loss_decay = 0.8
        c.draft.markov_rank = 0
        c.draft.enable_confidence_head = False
    elif model_type == "dspark":
        c.draft.markov_rank = 256
        c.draft.markov_head_type = "vanilla"
        c.draft.enable_confidence_head = True
        c.draft.confidence_head_alpha = 1.0
        c.draft.confidence_head_with_markov = True
        c.draft.ce_loss_alpha, c.draft.l1_loss_alpha = 0.1, 0.9
    else:  # DFlash: no Markov / confidence head, cross-entropy only
        c.draft.markov_rank = 0
        c.draft.enable_confidence_head = False
        c.draft.confidence_head_alpha = 0.0
        c.draft.ce_loss_alpha, c.draft.l1_loss_alpha = 1.0, 0.0
    c.data.max_length = 4096
    c.data.features = "online"
    c.train.global_batch_size = 512
    c.train.micro_batches = 16
    c.train.epochs = 10
    c.train.lr = 6e-4
    c.train.warmup_ratio = 0.04
    c.train.weight_decay = 0.0
    c.train.clip_norm = 1.0
    c.train.compute_dtype = "bfloat16"
    c.train.target_dtype = "bfloat16"
    c.train.log_every = 10
    c.checkpoint.every_steps = 3000
    return c
