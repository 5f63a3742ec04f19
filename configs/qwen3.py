"""The paper's / DeepSpec's Qwen3 DSpark settings, shared by qwen3_{4b,8b,14b}_dspark.py (SPEC §3–4):
5 draft layers, block 7, vanilla Markov head of rank 256, confidence head, mask token 151669 (the
first embedding row past Qwen3's 151669 tokenizer ids), AdamW lr 6e-4, global batch 512 sequences,
10 epochs, max_length 4096, bf16 compute with fp32 master weights, a checkpoint every 3000 steps.

`target` is a path: a local Hugging Face directory of the Qwen3 checkpoint
(`--config.target=/path/to/Qwen3-8B`). `data.prompts` should name the training-conversation JSONL
files to regenerate (DeepSpec's mixture); HumanEval is only the fallback.
"""

from configs.common import get_base_config

QWEN3_MASK_TOKEN = 151669


def qwen3_dspark_config(name: str, target_layer_ids: tuple[int, ...]):
    c = get_base_config()
    c.name = name
    c.target = ""                    # required: --config.target=/path/to/Qwen3-XB (HF directory)
    c.draft.model_type = "dspark"
    c.draft.num_draft_layers = 5
    c.draft.block_size = 7
    c.draft.markov_rank = 256
    c.draft.markov_head_type = "vanilla"
    c.draft.target_layer_ids = target_layer_ids
    c.draft.mask_token_id = QWEN3_MASK_TOKEN
    c.draft.num_anchors = 512
    c.data.max_length = 4096
    c.data.max_new_tokens = 2048
    c.data.regen_batch_size = 64
    c.data.features = "online"
    c.train.global_batch_size = 512
    c.train.micro_batches = 16
    c.train.epochs = 10
    c.train.lr = 6e-4
    c.train.compute_dtype = "bfloat16"
    c.train.target_dtype = "bfloat16"
    c.train.log_every = 10
    c.checkpoint.every_steps = 3000
    c.checkpoint.keep = 3
    c.eval.batch_size = 64
    return c
