"""Test support: a drafter trained briefly on its target's own greedy outputs, so that its drafts
get accepted and the multi-token commit paths of speculative decoding run."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from dspark_jax.decoding import autoregressive_generate
from dspark_jax.models import init_draft


def fit_draft(target: Any, draft_settings: dict, steps: int = 120
              ) -> tuple[Any, list[list[int]], list[list[int]]]:
    """(the trained drafter, 8 short prompts, the target's 28 greedy tokens for each): `steps`
    steps of the real jitted training step on the prompts and their greedy continuations."""
    from dspark_jax.sharding import make_mesh
    from dspark_jax.train.step import (OptimConfig, build_train_step, init_train_state,
                                       make_optimizer, make_schedule, split_draft)

    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, 90, 4)) for _ in range(8)]
    outs = autoregressive_generate(target, prompts, max_new_tokens=28, stop_token_ids=[])
    ids = np.asarray([p + o for p, o in zip(prompts, outs)], np.int32)
    B, S = ids.shape
    batch = dict(input_ids=ids, loss_mask=np.ones((B, S), np.int32),
                 positions=np.tile(np.arange(S, dtype=np.int32), (B, 1)),
                 segment_ids=np.ones((B, S), np.int32))
    draft = init_draft(target, dict(draft_settings, num_anchors=32), seed=0)
    gd, params, frozen = split_draft(draft.model)
    oc = OptimConfig(lr=1e-2, total_steps=steps)
    tx = make_optimizer(oc)
    mesh = make_mesh(devices=jax.devices()[:1])
    state, sh = init_train_state(params, tx, 0, mesh)
    fns = build_train_step(gd, draft.config, tx, make_schedule(oc), target_graphdef=target.graphdef,
                           mesh=mesh, state_sh=sh, frozen=frozen, target_state=target.state)
    for _ in range(steps):
        state, _ = fns.train(state, frozen, target.state, batch)
    return type(draft).from_model(nnx.merge(gd, state.params, frozen)), prompts, outs
