"""Tiny test config: a 2-layer drafter with block 4 on a tiny random target (tests only).

`target` must be given (`--config.target=/path/to/tiny_hf_dir`, a Hugging Face directory with a
tokenizer.json and a chat template). Everything is sized to run end to end on CPU in seconds.
"""

from dspark_jax.train.config_base import get_base_config


def get_config():
    c = get_base_config()
    c.name = "tiny"
    c.draft.block_size = 4
    c.draft.num_draft_layers = 2
    c.draft.markov_rank = 8
    c.draft.num_anchors = 8
    c.data.max_new_tokens = 32
    c.data.regen_batch_size = 4
    c.data.max_length = 128
    c.data.heldout = 2.0
    c.data.temperature = 1.0          # a random tiny target: sample broadly (fewer early stops)
    c.data.top_k = 0
    c.data.top_p = 1.0
    c.train.global_batch_size = 4
    c.train.epochs = 3
    c.train.lr = 3e-3
    c.train.compute_dtype = "float32"
    c.train.target_dtype = "float32"
    c.train.anchor_chunk = 8
    c.train.attn_key_chunk = 32      # several key chunks at max_length 128
    c.train.log_every = 1
    c.checkpoint.every_steps = 2
    c.checkpoint.keep = 2
    c.checkpoint.async_save = False
    c.mesh.num_devices = 1
    c.eval.batch_size = 2
    c.logging.progress = False
    return c
