"""`data.pad_to="longest"` trains the same step as `"max_length"`: with the same anchors, the loss,
every logged metric and the gradients (Adam's moments after one step) of a global batch padded
to its rounded longest sample equal those of the same batch padded to max_length, fp32, with
target features from a cache (offline) and from the target inside the step (online), over two
micro-batches.

Only the anchor DRAW depends on the width: `sample_anchors` scores [B, S] uniforms, as DeepSpec's
sampler draws `torch.rand(B, S − 1)` over its padded length; the candidates (i with
loss_mask[i] = loss_mask[i+1] = 1) and the uniform choice among them are the same. The test's
sampler pads the masks to max_length before calling ours, so both widths take one draw.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax

from dspark_jax.data.pipeline import PipelineConfig, make_dataset
from dspark_jax.models import init_draft, load_target
from dspark_jax.sharding import make_mesh
from dspark_jax.train import losses
from dspark_jax.train import step as st
from hf_tiny import save_tiny_hf

MAX_LENGTH, MULTIPLE, B, M = 32, 8, 4, 2
LAYER_IDS = (-1, 0)
SCALAR_RTOL = 1e-5
TENSOR_RTOL = 1e-5      # per tensor, of its largest entry: fp32 sums in another chunking


def _records(hidden: int, n: int = 8) -> list[dict[str, np.ndarray]]:
    """n samples of 6..18 tokens (a prompt, then a reply with loss mask 1) with random target
    taps [L, 2·hidden] and final hidden states [L, hidden]."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        length = int(rng.integers(6, 19))
        mask = np.zeros(length, np.int32)
        mask[1 + i % 3:] = 1
        out.append(dict(input_ids=rng.integers(3, 90, length).astype(np.int32), loss_mask=mask,
                        features=rng.standard_normal((length, len(LAYER_IDS) * hidden)
                                                     ).astype(np.float32),
                        target_hidden=rng.standard_normal((length, hidden)).astype(np.float32)))
    return out


def _shared_draw_sampler():
    """Our `sample_anchors` on the masks padded to MAX_LENGTH: a batch's anchors whatever its
    width (every kept anchor lies inside its sample)."""
    real = losses.sample_anchors

    def sample(key, loss_mask, num_anchors, segment_ids=None, max_segments=1):
        pad = ((0, 0), (0, MAX_LENGTH - loss_mask.shape[1]))
        seg = None if segment_ids is None else jax.numpy.pad(segment_ids, pad)
        return real(key, jax.numpy.pad(loss_mask, pad), num_anchors, seg, max_segments)

    return sample


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target = load_target(save_tiny_hf(tmp_path_factory.mktemp("pad_target"), "qwen3", layers=2))
    draft = init_draft(target, dict(block_size=3, num_draft_layers=1, target_layer_ids=LAYER_IDS,
                                    mask_token_id=96, markov_rank=4, num_anchors=4), seed=1)
    return target, draft


@pytest.mark.parametrize("features", ["offline", "online"])
def test_step_on_longest_padding_equals_step_on_max_length_padding(tiny, features, monkeypatch):
    target, draft = tiny
    recs = _records(target.config.hidden_size)
    online = features == "online"
    if online:
        recs = [{k: r[k] for k in ("input_ids", "loss_mask")} for r in recs]
    kw = dict(batch_size=B, max_length=MAX_LENGTH, seed=2, micro_batches=M)
    full = next(iter(make_dataset(recs, PipelineConfig(**kw), shard_index=0, shard_count=1)))
    short = next(iter(make_dataset(recs, PipelineConfig(**kw, pad_to="longest",
                                                        pad_multiple=MULTIPLE),
                                   shard_index=0, shard_count=1)))
    width = short["input_ids"].shape[1]
    assert width < MAX_LENGTH and width % MULTIPLE == 0, width
    for k in full:
        np.testing.assert_array_equal(short[k], full[k][:, :width], err_msg=k)

    monkeypatch.setattr(losses, "sample_anchors", _shared_draw_sampler())
    mesh = make_mesh(data=1, devices=jax.devices()[:1])
    graphdef, params, frozen = st.split_draft(draft.model)
    oc = st.OptimConfig(total_steps=10, warmup_ratio=0.0)
    tx = st.make_optimizer(oc)
    target_state = target.state if online else None
    # anchor_chunk 2 and attn_key_chunk 8: the two widths take different numbers of key chunks
    fns = None
    results = []
    for batch in (full, short):
        state, sh = st.init_train_state(jax.tree.map(np.array, params), tx, 0, mesh)  # donated
        if fns is None:
            fns = st.build_train_step(graphdef, draft.config, tx, st.make_schedule(oc),
                                      target_graphdef=target.graphdef if online else None,
                                      mesh=mesh, state_sh=sh, frozen=frozen,
                                      target_state=target_state, micro_batches=M, anchor_chunk=2,
                                      attn_key_chunk=8, attn_kernel=False)
        new, metrics = fns.train(state, frozen, target_state, batch)
        results.append((jax.device_get(metrics), jax.device_get(new.opt_state)))
    (m_full, opt_full), (m_short, opt_short) = results
    assert m_full["grad_norm"] > 0 and m_full["sampled_anchors_abs"] > 0
    worst_scalar = worst_tensor = 0.0
    for k in m_full:
        np.testing.assert_allclose(m_short[k], m_full[k], rtol=SCALAR_RTOL, atol=1e-9, err_msg=k)
        worst_scalar = max(worst_scalar, abs(float(m_short[k]) - float(m_full[k]))
                           / max(abs(float(m_full[k])), 1e-12))
    moments = zip(jax.tree.leaves(opt_short), jax.tree.leaves(opt_full))
    n = 0
    for got, ref in moments:
        ref, got = np.asarray(ref), np.asarray(got)
        if ref.dtype.kind != "f" or ref.ndim == 0:
            continue
        scale = float(np.abs(ref).max())
        err = float(np.abs(got - ref).max())
        assert err <= TENSOR_RTOL * scale + 1e-12, (err, scale)
        worst_tensor = max(worst_tensor, err / max(scale, 1e-30))
        n += 1
    assert n >= 4          # both Adam moments of the drafter's tensors were compared
    print(f"\n{features}: width {width} vs {MAX_LENGTH}, scalars rel {worst_scalar:.2g}, "
          f"Adam moments rel {worst_tensor:.2g}")
