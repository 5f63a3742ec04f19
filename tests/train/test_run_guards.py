"""Non-finite steps: the jitted step leaves the state untouched on a batch whose loss is not
finite (the run then equals one without that batch), the loop's guard counts, logs and trips on
them, and `train.max_nonfinite_steps` is checked. (The whole loop stopping on them, and
pre-emption: test_checkpoint.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import init_draft, load_target
from dspark_jax.sharding import make_mesh
from dspark_jax.train.config_base import get_base_config
from dspark_jax.train.job_config import UsageError, validate_config
from dspark_jax.train.run_guards import NonFiniteGuard
from dspark_jax.train.step import (OptimConfig, build_train_step, init_train_state,
                                   make_optimizer, make_schedule, split_draft)
from hf_tiny import save_tiny_hf

DRAFT = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1), mask_token_id=96,
             markov_rank=8, num_anchors=6)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                    layers=4))


def _offline_batch(target, seed: int, B: int = 2, S: int = 24) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    ids = rng.randint(3, 90, (B, S)).astype(np.int32)
    lm = np.ones((B, S), np.int32)
    lm[:, :5] = 0
    out = target.model(jnp.asarray(ids), tap_layer_ids=(0, 1))
    return dict(input_ids=ids, loss_mask=lm,
                positions=np.tile(np.arange(S, dtype=np.int32), (B, 1)),
                segment_ids=np.ones((B, S), np.int32),
                features=np.asarray(out.taps), target_hidden=np.asarray(out.hidden))


def _run(target, batches):
    """A fresh drafter trained on `batches` (offline features); the final state and metrics."""
    draft = init_draft(target, DRAFT, seed=1)
    gd, params, frozen = split_draft(draft.model)
    oc = OptimConfig(lr=3e-3, total_steps=10)
    tx = make_optimizer(oc)
    mesh = make_mesh(devices=jax.devices()[:1])
    state, sh = init_train_state(params, tx, 0, mesh)
    fns = build_train_step(gd, draft.config, tx, make_schedule(oc), target_graphdef=None,
                           target_state=None, mesh=mesh, state_sh=sh, frozen=frozen)
    metrics = []
    for b in batches:
        state, m = fns.train(state, frozen, None, b)
        metrics.append(jax.device_get(m))
    return state, metrics


def test_a_nan_batch_is_skipped_and_the_run_equals_one_without_it(target):
    b0, b1, b2 = (_offline_batch(target, s) for s in range(3))
    poisoned = dict(b1, features=b1["features"].copy())
    poisoned["features"][0, 7] = np.nan                    # one position of one row
    with_nan, m = _run(target, [b0, poisoned, b2])
    without, _ = _run(target, [b0, b2])
    assert [int(x["nonfinite"]) for x in m] == [0, 1, 0]
    assert not np.isfinite(float(m[1]["loss"]))
    assert np.isfinite(float(m[2]["loss"])) and int(with_nan.step) == 3
    for a, b in zip(jax.tree.leaves((with_nan.params, with_nan.opt_state)),
                    jax.tree.leaves((without.params, without.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(jax.random.key_data(with_nan.key),
                                  jax.random.key_data(without.key))


def test_guard_counts_logs_and_trips_on_max_in_a_row():
    lines: list[str] = []
    g = NonFiniteGuard(3, total=1, write=lines.append)     # one counted before a resume
    flags = [0, 1, 1, 0, 1, 1, 1, 0]
    for step, flag in enumerate(flags, start=1):
        g.defer(step, np.int32(flag), f"fp{step}")
        if step == 6:
            assert not g.tripped        # step 7's flag is still deferred
    g.resolve()
    assert g.total == 1 + sum(flags) and g.tripped_at == 7 and g.tripped
    assert g.counters() == {"nonfinite_steps": 6, "nonfinite_in_a_row": 0}
    assert len(lines) == 5 and lines[0].startswith("step 2:") and "fp2" in lines[0]
    assert "3 in a row" in lines[-1] and "fp7" in lines[-1]
    err = str(g.error("/ck/8"))
    assert err.startswith("stopped at step 7: steps 5-7") and "train.max_nonfinite_steps" in err
    assert "\n" not in err


def test_max_nonfinite_steps_is_validated():
    c = get_base_config()
    c.target = "x"
    assert c.train.max_nonfinite_steps == 10
    c.train.max_nonfinite_steps = 0
    with pytest.raises(UsageError, match="train.max_nonfinite_steps"):
        validate_config(c)
