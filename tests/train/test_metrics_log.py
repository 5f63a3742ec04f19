"""Training metrics carry DeepSpec's names (deepspec/modeling/*/loss.py,
common.py `log_sampler_stats`, utils/training_logger.py), identically in TensorBoard
(`train/<name>`, DeepSpec's tags) and in metrics.jsonl (`<name>`)."""

from __future__ import annotations

import struct

import jax.numpy as jnp
import pytest

from dspark_jax.models.config import DecoderConfig
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.train.eagle3_loss import eagle3_metrics_from_sums
from dspark_jax.train.losses import metrics_from_sums
from dspark_jax.train.metrics_log import MetricsLogger, read_jsonl

TARGET = DecoderConfig(family="qwen3", vocab_size=64, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=8, qk_norm=True)
# what DeepSpec's trainers add_metric(…, tag="train") for each drafter (lr / grad_norm come from
# the optimizer step)
DSPARK = ({f"accept_rate@{k}" for k in range(4)}
          | {"loss", "ce_loss", "l1_loss", "confidence_loss", "tau_probabilistic",
             "confidence_abs_error", "confidence_bias", "confidence_cumprod_bias",
             "valid_anchors_abs", "valid_anchors_ratio", "sampled_anchors_abs",
             "sampled_anchors_ratio", "block_supervised_tokens_abs",
             "block_supervised_tokens_ratio"})
DFLASH = DSPARK - {"l1_loss", "confidence_loss", "confidence_abs_error", "confidence_bias",
                   "confidence_cumprod_bias"}
EAGLE3 = ({f"{m}@{s}" for m in ("accuracy", "accept_rate", "valid_tokens") for s in range(3)}
          | {f"ploss_{s}" for s in range(3)} | {"loss", "tau_greedy", "tau_probabilistic"})


def _dspark_sums(g=4):
    one = jnp.ones((), jnp.float32)
    s = {k: one for k in ("ce", "l1", "weight", "conf", "conf_abs_err", "conf_bias",
                          "conf_cumprod_bias", "tau_sum", "tau_blocks", "samples",
                          "valid_anchors", "valid_anchors_ratio", "sampled_anchors",
                          "sampled_anchors_ratio", "block_supervised_tokens",
                          "block_supervised_tokens_ratio")}
    s.update(mask=jnp.ones((g,)), accept=jnp.ones((g,)))
    return s


def _eagle3_sums(T=3):
    s = {k: jnp.ones((T,)) for k in ("step_num", "step_den", "step_tokens", "step_correct",
                                     "step_accept")}
    s.update({k: jnp.ones(()) for k in ("objective", "weight", "tau_greedy_sum", "tau_prob_sum",
                                        "tau_count")})
    return s


def _tensorboard_tags(tb_dir) -> set[str]:
    """Scalar tags of the event files (TFRecord framing: length, crc, event proto, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    tags = set()
    for f in tb_dir.iterdir():
        data = f.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            ev = Event.FromString(data[at + 12:at + 12 + n])
            tags |= {v.tag for v in ev.summary.value}
            at += 12 + n + 4
    return tags


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_metric_names_are_deepspec_s_in_tensorboard_and_jsonl(tmp_path, kind):
    if kind == "eagle3":
        cfg = DraftConfig(target=TARGET, model_type="eagle3", ttt_length=3)
        metrics, want = eagle3_metrics_from_sums(_eagle3_sums()), EAGLE3
    else:
        cfg = DraftConfig(target=TARGET, model_type=kind, block_size=4, markov_rank=8,
                          target_layer_ids=(0, 1), mask_token_id=63)
        metrics, want = metrics_from_sums(_dspark_sums(), cfg), (DSPARK if kind == "dspark"
                                                                 else DFLASH)
    metrics = dict(metrics, lr=1e-3, grad_norm=0.5)
    assert want | {"lr", "grad_norm"} <= set(metrics), sorted(want - set(metrics))
    log = MetricsLogger(tmp_path, total_steps=1, progress=False)
    log.log(1, metrics, tokens=10, batch_hash="abc")
    log.close(final=False)
    row = read_jsonl(tmp_path / "metrics.jsonl")[0]
    logged = set(row) - {"step", "time", "batch_hash"}
    assert logged >= want | {"lr", "grad_norm"}
    assert _tensorboard_tags(tmp_path / "tensorboard") == {f"train/{k}" for k in logged}
