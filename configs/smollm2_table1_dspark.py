"""Small-scale Table 1 (DSpark paper §4, Table 1: DSpark vs DFlash vs Eagle3 at the same data and
budget) on SmolLM2-135M-Instruct, DSpark row; `table1_config` is shared by
configs/smollm2_table1_{dspark,dflash,eagle3}.py. Run all three with
`python -m dspark_jax.bench.table1 --workdir DIR` (one shared regeneration, resumable).

Identical in the three rows: the prompts (the default job's: a seeded 480-prompt subsample of
`offline-mix`, 32 held out by id hash), the regenerated replies (one regeneration, pointed at by
`data.regenerated`), the cached target features (same target layer ids), sequence length, batch 8,
the steps (`train.max_steps`), optimizer, learning rate and warmup, the data order
(`data.data_seed`) and the held-out learning curve (`eval.every_steps`). Different: the drafter,
and its init seed as in DeepSpec (42 for DSpark / DFlash, 0 for Eagle3).

DeepSpec's recipes (config/{dspark,dflash,eagle3}/*_qwen3_4b.py) scaled down:
  DSpark : 2 draft layers (DeepSpec: 5), block 7, vanilla Markov head of rank 64 (256),
           confidence head (alpha 1.0, fed the Markov embedding), loss decay gamma 4.0,
           CE 0.1 + L1 0.9, 16 anchors (512).
  DFlash : the same backbone (2 layers, block 7, 16 anchors, gamma 4.0) without the Markov and
           confidence heads, CE only (ce 1.0, l1 0.0).
  Eagle3 : one draft layer, training-time test of length 7, step loss decay 0.8.
"""

from configs import smollm2_dspark

DRAFTERS = ("dspark", "dflash", "eagle3")
SEEDS = {"dspark": 42, "dflash": 42, "eagle3": 0}   # DeepSpec's config/*/*.py
TABLE1_STEPS = 300
TABLE1_EVAL_EVERY = 30


def table1_config(model_type: str):
    """The ConfigDict of one Table 1 row (`model_type` in DRAFTERS)."""
    if model_type not in DRAFTERS:
        raise ValueError(f"Table 1 drafter {model_type!r} is not one of {DRAFTERS}")
    c = smollm2_dspark.get_config()
    c.name = f"smollm2_table1_{model_type}"
    c.seed = SEEDS[model_type]
    c.train.max_steps = TABLE1_STEPS
    c.eval.every_steps = TABLE1_EVAL_EVERY
    d = c.draft
    d.model_type = model_type
    if model_type == "eagle3":
        d.draft_num_hidden_layers = 1
        d.ttt_length = 7
        d.step_loss_decay = 0.8
        d.markov_rank = 0
        d.enable_confidence_head = False
        d.confidence_head_alpha = 0.0
        return c
    d.num_draft_layers = 2
    d.block_size = 7
    d.num_anchors = 16
    d.loss_decay_gamma = 4.0
    if model_type == "dspark":
        d.markov_rank = 64
        d.markov_head_type = "vanilla"
        d.enable_confidence_head = True
        d.confidence_head_alpha = 1.0
        d.confidence_head_with_markov = True
        d.ce_loss_alpha = 0.1
        d.l1_loss_alpha = 0.9
    else:
        d.markov_rank = 0
        d.enable_confidence_head = False
        d.confidence_head_alpha = 0.0
        d.ce_loss_alpha = 1.0
        d.l1_loss_alpha = 0.0
    return c


def get_config():
    return table1_config("dspark")
