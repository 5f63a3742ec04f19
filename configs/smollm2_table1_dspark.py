"""Small-scale Table 1 (DSpark paper §4, Table 1: DSpark vs DFlash vs Eagle3 at the same data and
budget) on SmolLM2-135M-Instruct, DSpark row; `table1_config` is shared by
configs/smollm2_table1_{dspark,dflash,eagle3}.py. Run all three with
`python -m dspark_jax.experiments.table1 --workdir DIR` (one shared regeneration, resumable).

Identical in the three rows: the prompts (the default job's: a seeded 480-prompt subsample of
`offline-mix`, 32 held out by id hash), the regenerated replies (one regeneration, pointed at by
`data.regenerated`), the cached target features (same target layer ids), sequence length, batch 8,
the steps (`train.max_steps`), optimizer, learning rate and warmup, the data order
(`data.data_seed`), the held-out learning curve (`eval.every_steps`) and the draft vocabulary
(the default job's 8,192 ids chosen from the same records, EAGLE-3's pruning — DeepSpec trains all
three over the full vocabulary; on 2 cores that made Eagle3's TTT step 27 s, and K = 8,192 cuts
every row's LM-head work by 6×; `--set draft.draft_vocab_size=0` restores DeepSpec's). Different:
the drafter, and its init seed as in DeepSpec (42 for DSpark / DFlash, 0 for Eagle3).

DeepSpec's recipes (config/{dspark,dflash,eagle3}/*_qwen3_4b.py) scaled down:
  DSpark : 2 draft layers (DeepSpec: 5), block 7, vanilla Markov head of rank 64 (256),
           confidence head (alpha 1.0, fed the Markov embedding), loss decay gamma 4.0,
           CE 0.1 + L1 0.9, 16 anchors (512).
  DFlash : the same backbone (2 layers, block 7, 16 anchors, gamma 4.0) without the Markov and
           confidence heads, CE only (ce 1.0, l1 0.0).
  Eagle3 : one draft layer, training-time test of length 7, step loss decay 0.8.
"""

from configs import smollm2_dspark
from dspark_jax.train.config_base import apply_deepspec_recipe

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
    c.data.max_prompts = 480         # the 480-prompt subsample, 32 held out (see above)
    c.data.heldout = 32.0
    c.train.init_from_target = False   # DeepSpec's random init for every row (Eagle3 has no other)
    apply_deepspec_recipe(c.draft, model_type, draft_layers=2, markov_rank=64, num_anchors=16)
    return c


def get_config():
    return table1_config("dspark")
