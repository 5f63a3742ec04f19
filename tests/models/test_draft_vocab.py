"""A pruned draft vocabulary (DraftConfig.draft_vocab): how the ids are chosen from training
records, config validation, and a drafter that never proposes a token outside it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.data.draft_vocab import choose_draft_vocab, coverage
from dspark_jax.models import init_draft, load_target
from dspark_jax.models.config import ConfigError
from dspark_jax.decoding.sampling import sample_probs
from hf_tiny import save_tiny_hf

BASE = dict(block_size=4, num_draft_layers=1, target_layer_ids=(0, 1), mask_token_id=96,
            markov_rank=8)
VOCAB = tuple(range(1, 96, 3))   # 32 of 97 ids


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                    layers=3))


def _rec(ids, mask):
    return {"input_ids": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, np.int16)}


def test_choice_ranks_assistant_tokens_then_prompt_tokens_then_low_ids():
    recs = [_rec([9, 9, 9, 5, 7, 7, 7, 7], [0, 0, 0, 1, 1, 1, 1, 1]),
            _rec([8, 5, 6], [0, 1, 1])]
    # assistant counts: 7×4, 5×2, 6×1; prompt counts: 9×3, 8×1; then ids 0, 1, …
    assert choose_draft_vocab(recs, 3, 20) == (5, 6, 7)
    assert choose_draft_vocab(recs, 5, 20) == (5, 6, 7, 8, 9)
    assert choose_draft_vocab(recs, 7, 20) == (0, 1, 5, 6, 7, 8, 9)
    # a stop id is always in it, even unseen, displacing the least frequent
    assert choose_draft_vocab(recs, 3, 20, always=[19]) == (5, 7, 19)
    assert coverage(recs, (5, 7), 20) == pytest.approx(6 / 7)
    with pytest.raises(ValueError, match="outside"):
        choose_draft_vocab(recs, 21, 20)
    with pytest.raises(ValueError, match="do not fit"):
        choose_draft_vocab(recs, 1, 20, always=[1, 2])


def test_config_validation_names_the_field(target):
    with pytest.raises(ConfigError, match="draft_vocab"):
        init_draft(target, dict(BASE, draft_vocab_size=3, draft_vocab=(5, 4, 9)))
    with pytest.raises(ConfigError, match="draft_vocab"):
        init_draft(target, dict(BASE, draft_vocab_size=4, draft_vocab=(1, 2, 3)))
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        init_draft(target, dict(BASE, draft_vocab_size=98))
    unresolved = init_draft(target, dict(BASE, draft_vocab_size=32)).model
    with pytest.raises(ValueError, match="no ids"):
        unresolved.vocab_ids()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_proposals_stay_inside_the_draft_vocabulary(target, temperature):
    full = init_draft(target, BASE, seed=1).model
    pruned = init_draft(target, dict(BASE, draft_vocab_size=len(VOCAB), draft_vocab=VOCAB),
                        seed=1).model
    h = jax.random.normal(jax.random.key(0), (64, 4, 32))
    anchor = jnp.arange(64, dtype=jnp.int32) % 90
    T = jnp.asarray(temperature, jnp.float32)
    out = pruned.sample_block(h, anchor, jax.random.key(1), T, sample_probs)
    toks, probs = np.asarray(out["tokens"]), np.asarray(out["probs"])
    assert np.isin(toks, VOCAB).all()
    outside = np.setdiff1d(np.arange(97), VOCAB)
    assert probs[..., outside].max() == 0.0
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    # the same weights without pruning propose outside tokens: the restriction is what did it
    ref = full.sample_block(h, anchor, jax.random.key(1), T, sample_probs)
    assert not np.isin(np.asarray(ref["tokens"]), VOCAB).all()
    # inside the vocabulary, the logits are the unpruned ones: compact training logits agree
    rows = jnp.take(pruned.lm_head.get_value(), jnp.asarray(VOCAB), axis=0)
    prev = jnp.tile(anchor[:, None], (1, 4))
    compact, _ = pruned.heads_teacher_forced(h, prev, lm_head_rows=rows)
    dense, _ = full.heads_teacher_forced(h, prev)
    np.testing.assert_allclose(np.asarray(compact), np.asarray(dense)[..., list(VOCAB)],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type,confidence", [("dflash", False), ("dspark", True)])
def test_a_drafter_without_a_markov_head_samples_every_slot_at_once_as_one_at_a_time(
        target, model_type, confidence):
    """No slot reads the token before it without a Markov head (DFlash; DSpark with rank 0),
    so `sample_block` samples them all at once: each slot's probabilities, token (drawn with
    that slot's key) and confidence equal the slot taken alone."""
    from pallas_kernels.common import probs_from_logits

    draft = init_draft(target, dict(BASE, model_type=model_type, markov_rank=0,
                                    enable_confidence_head=confidence), seed=2).model
    assert not draft.cfg.has_markov
    h = jax.random.normal(jax.random.key(3), (6, 4, 32))
    anchor = jnp.arange(6, dtype=jnp.int32)
    T = jnp.asarray(0.8, jnp.float32)
    out = draft.sample_block(h, anchor, jax.random.key(4), T, sample_probs)
    base = draft.draft_vocab_logits(h, None)
    keys = jax.random.split(jax.random.key(4), 4)
    for k in range(4):
        p = probs_from_logits(base[:, k], T)
        np.testing.assert_allclose(np.asarray(out["probs"][:, k]), np.asarray(p), rtol=1e-6,
                                   atol=1e-7)
        np.testing.assert_array_equal(np.asarray(out["tokens"][:, k]),
                                      np.asarray(sample_probs(keys[k], p)))
        if confidence:
            np.testing.assert_allclose(np.asarray(out["confidence"][:, k]),
                                       np.asarray(draft.confidence(h[:, k], None)), rtol=1e-6)
    assert len({tuple(np.asarray(out["tokens"][:, k])) for k in range(4)}) > 1   # own keys
