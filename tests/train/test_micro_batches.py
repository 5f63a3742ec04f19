"""Micro-batches span every data shard: strided rows, and no batch resharding in the step's HLO
(8 fake CPU devices, data-parallel mesh)."""

import re

import jax
import numpy as np
import pytest

from dspark_jax.models import init_draft, load_target
from dspark_jax.sharding import make_mesh
from dspark_jax.train import step as st
from hf_tiny import save_tiny_hf

RESHARD = ("all-to-all", "collective-permute")


def test_every_micro_batch_takes_rows_from_every_shard():
    B, m, shards = 24, 3, 4
    rows = np.asarray(st.micro_batches_of(np.arange(B), m))             # [m, B/m]
    assert sorted(rows.ravel().tolist()) == list(range(B))
    shard_of = rows // (B // shards)                                    # contiguous row blocks
    for i in range(m):
        assert sorted(set(shard_of[i].tolist())) == list(range(shards)), rows[i]
        # and equally many from each shard, so the micro-batch keeps the batch sharding
        assert np.all(np.bincount(shard_of[i], minlength=shards) == B // (m * shards))


def _collectives(micro_fn, monkeypatch, tmp_path) -> dict[str, int]:
    target = load_target(save_tiny_hf(tmp_path, "qwen3", head_dim=16, layers=2))
    draft = init_draft(target, dict(block_size=3, num_draft_layers=1, target_layer_ids=(0,),
                                    mask_token_id=96, markov_rank=4, num_anchors=4), seed=1)
    monkeypatch.setattr(st, "micro_batches_of", micro_fn)
    mesh = make_mesh(data=8)
    gd, params, frozen = st.split_draft(draft.model)
    oc = st.OptimConfig(total_steps=10)
    tx = st.make_optimizer(oc)
    state, sh = st.init_train_state(params, tx, 0, mesh)
    fns = st.build_train_step(gd, draft.config, tx, st.make_schedule(oc),
                              target_graphdef=target.graphdef, mesh=mesh, state_sh=sh,
                              frozen=frozen, target_state=target.state, micro_batches=2)
    B, S = 16, 16
    batch = dict(input_ids=np.ones((B, S), np.int32), loss_mask=np.ones((B, S), np.int32),
                 positions=np.tile(np.arange(S, dtype=np.int32), (B, 1)),
                 segment_ids=np.ones((B, S), np.int32))
    hlo = fns.train.lower(state, frozen, target.state, batch).compile().as_text()
    return {k: len(re.findall(k, hlo)) for k in RESHARD}


@pytest.mark.slow   # one compile of the sharded step, slow on a small CPU host
def test_step_hlo_has_no_batch_resharding(monkeypatch, tmp_path):
    assert len(jax.devices()) == 8
    got = _collectives(st.micro_batches_of, monkeypatch, tmp_path)
    assert got == {k: 0 for k in RESHARD}, got


@pytest.mark.slow   # the counter-example: contiguous micro-batches do reshard (one more compile)
def test_contiguous_micro_batches_would_reshard(monkeypatch, tmp_path):
    contiguous = lambda x, m: x.reshape((m, x.shape[0] // m) + x.shape[1:])
    got = _collectives(contiguous, monkeypatch, tmp_path)
    assert sum(got.values()) > 0, got
