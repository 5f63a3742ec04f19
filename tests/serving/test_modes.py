"""A scheduler mode is one object (`serving.modes`): a mode defined here, outside the package, as
one class serves through `Engine` losslessly; the modes are hashable parts of the round's static
config; names are looked up once, where settings arrive as strings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.decoding import autoregressive_generate
from dspark_jax.decoding.round_types import RoundConfig
from dspark_jax.models import init_draft, load_target
from dspark_jax.serving import Engine, policy
from dspark_jax.serving.modes import SchedulerMode, mode_names, scheduler_mode
from dspark_jax.serving.settings import EngineSettings
from hf_tiny import save_tiny_hf


@dataclasses.dataclass(frozen=True)
class AtMost(SchedulerMode):
    """A toy mode: every active request verifies its first `k` drafts (at most γ)."""

    k: int = 1
    name = "at_most"

    def schedule(self, conf: jax.Array, active: jax.Array, gamma: int, threshold: jax.Array,
                 sps: jax.Array, capacity: jax.Array, sps_draft: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        lengths = jnp.where(active, min(self.k, gamma), 0).astype(jnp.int32)
        return lengths, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)


PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [3]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                      layers=1, seed=1))
    draft = init_draft(target, dict(block_size=3, num_draft_layers=1, target_layer_ids=(-1,),
                                    mask_token_id=96, markov_rank=8), seed=3)
    return target, draft


def test_a_toy_mode_serves_through_the_engine(models):
    target, draft = models
    eng = Engine(target, draft, scheduler=AtMost(k=1), max_requests=2, max_len=32,
                 stop_token_ids=[])
    assert eng.config.mode == AtMost(k=1) and isinstance(eng.policy, policy.AlwaysDraft)
    res = eng.generate(PROMPTS, max_new_tokens=MAX_NEW)
    ref = autoregressive_generate(target, PROMPTS, max_new_tokens=MAX_NEW, stop_token_ids=[])
    assert res.tokens == ref
    assert all(p <= 1 for r in res.per_request for p in r["proposed"])
    assert any(p == 1 for r in res.per_request for p in r["proposed"])


def test_modes_are_static_config():
    a = RoundConfig(mode=AtMost(k=2), buckets=(4, 8))
    assert hash(a) == hash(dataclasses.replace(a, mode=AtMost(k=2)))
    assert a != dataclasses.replace(a, mode=AtMost(k=1))
    assert a != dataclasses.replace(a, mode=scheduler_mode("fixed"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        AtMost().k = 3


def test_names_are_looked_up_once_with_the_valid_choices():
    assert mode_names() == ("none", "fixed", "threshold", "algorithm1", "production",
                            "adaptive")
    assert EngineSettings(scheduler="algorithm1").validate().mode is scheduler_mode("algorithm1")
    assert EngineSettings(scheduler=AtMost(k=2)).validate().mode == AtMost(k=2)
    with pytest.raises(ValueError, match=r"unknown scheduler 'greedy'; choose from \['none'"):
        EngineSettings(scheduler="greedy").validate()

    class Unhashable(AtMost):
        __hash__ = None   # type: ignore[assignment]

    with pytest.raises(ValueError, match="scheduler: a scheduler mode must be hashable"):
        EngineSettings(scheduler=Unhashable()).validate()
