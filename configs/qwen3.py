"""The paper's / DeepSpec's Qwen3 settings for every drafter, shared by
configs/qwen3_{4b,8b,14b}_{dspark,dflash,eagle3}.py (SPEC §3–5; DeepSpec's config/{dspark,dflash,eagle3}/*).

DSpark  : 5 draft layers, block 7, vanilla Markov head of rank 256, confidence head (alpha 1.0, fed the
          Markov embedding), loss decay gamma 4.0, CE weight 0.1 + L1 weight 0.9, 512 anchors, seed 42.
DFlash  : the same backbone without Markov and confidence heads, CE only (ce 1.0, l1 0.0), seed 42.
Eagle3  : one draft layer, training-time test of length 7, step loss decay 0.8, seed 0.
All     : target layer ids as DeepSpec lists them, mask token 151669 (the first embedding row past
          Qwen3's 151669 tokenizer ids), AdamW lr 6e-4 with 4 % warmup, no weight decay, gradient
          clipping at 1.0, global batch 512 sequences, 10 epochs, max_length 4096, bf16 compute with
          fp32 master weights, metrics every 10 steps, a checkpoint every 3000 steps.

DeepSpec runs one sequence per GPU (local_batch_size=1) and accumulates to 512; here the global batch
is split into `train.micro_batches` accumulation steps inside the jitted step (16 by default: 32
sequences per micro-step over the data axis); raise it if a micro-batch does not fit.

`target` is a path: a local Hugging Face directory of the Qwen3 checkpoint
(`--config.target=/path/to/Qwen3-8B`). `data.prompts` should name the training-conversation JSONL
files to regenerate (DeepSpec's mixture); HumanEval is only the fallback.
"""

from dspark_jax.train.config_base import apply_deepspec_recipe, get_base_config

QWEN3_MASK_TOKEN = 151669

# DeepSpec's target_layer_ids per Qwen3 size (config/*/*_qwen3_{4b,8b,14b}.py)
QWEN3_TARGET_LAYER_IDS = {
    "4b": (1, 9, 17, 25, 33),     # 36 layers
    "8b": (1, 9, 17, 25, 33),     # 36 layers
    "14b": (1, 10, 19, 28, 37),   # 40 layers
}
DRAFTERS = ("dspark", "dflash", "eagle3")
SEEDS = {"dspark": 42, "dflash": 42, "eagle3": 0}


def qwen3_config(size: str, model_type: str):
    """The ConfigDict of DeepSpec's `<model_type>_qwen3_<size>` run."""
    if size not in QWEN3_TARGET_LAYER_IDS:
        raise ValueError(f"Qwen3 size {size!r} is not one of {sorted(QWEN3_TARGET_LAYER_IDS)}")
    if model_type not in DRAFTERS:
        raise ValueError(f"drafter {model_type!r} is not one of {DRAFTERS}")
    c = get_base_config()
    c.name = f"qwen3_{size}_{model_type}"
    c.target = ""                    # required: --config.target=/path/to/Qwen3-XB (HF directory)
    c.seed = SEEDS[model_type]
    d = c.draft
    d.target_layer_ids = QWEN3_TARGET_LAYER_IDS[size]
    d.mask_token_id = QWEN3_MASK_TOKEN
    apply_deepspec_recipe(d, model_type, draft_layers=5, markov_rank=256, num_anchors=512)
    c.data.max_length = 4096
    c.data.max_new_tokens = 2048
    c.data.regen_batch_size = 64
    c.data.features = "online"
    t = c.train
    t.global_batch_size = 512
    t.micro_batches = 16
    t.epochs = 10
    t.max_steps = -1
    t.lr = 6e-4
    t.warmup_ratio = 0.04
    t.weight_decay = 0.0
    t.clip_norm = 1.0
    t.compute_dtype = "bfloat16"
    t.target_dtype = "bfloat16"
    t.log_every = 10
    c.checkpoint.every_steps = 3000
    c.checkpoint.keep = 3
    c.eval.batch_size = 64
    return c

