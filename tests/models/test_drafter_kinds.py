"""A drafter kind is one `DrafterKind` record: every registered kind's adapter and loss load from
the layers that use them, an unknown kind is refused by name, adapters return a typed
`Proposal`, and a toy kind defined here — outside the package, one record reusing DFlash's
module, layout, adapter and loss — is built, exported, loaded back, served and trained by name
without touching any package file."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.draft_adapters import (DrafterAdapter, DSparkAdapter, Eagle3Adapter,
                                                Proposal, adapter_for)
from dspark_jax.models import (ConfigError, DecoderConfig, DraftConfig, init_draft, load_draft,
                               load_target)
from dspark_jax.models import drafter_kinds as K
from dspark_jax.models.drafters import kind as kind_registry
from dspark_jax.models.drafters.kind import Ref, drafter_kind, drafter_kinds
from dspark_jax.models.io import drafter_layouts
from dspark_jax.train.drafter_loss import DrafterLoss, loss_for
from dspark_jax.train.losses import DFLASH_LOSS
from hf_tiny import save_tiny_hf

BASE = dict(block_size=4, num_draft_layers=2, target_layer_ids=(0, 1), mask_token_id=96)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16,
                                    layers=4))


def test_every_kind_names_an_adapter_and_a_loss_in_their_layers():
    assert set(drafter_kinds()) == {"dspark", "dflash", "eagle3"}
    for name, kind in drafter_kinds().items():
        assert drafter_kind(name) is kind
        assert kind.adapter.path.startswith("dspark_jax.decoding.")
        assert kind.loss.path.startswith("dspark_jax.train.")
        assert issubclass(adapter_for(name), DrafterAdapter)
        assert isinstance(kind.loss.load(), DrafterLoss)
    assert adapter_for("eagle3") is Eagle3Adapter and adapter_for("dflash") is DSparkAdapter
    assert DSparkAdapter.drafts_trees and DSparkAdapter.markov_kernel
    assert not (Eagle3Adapter.drafts_trees or Eagle3Adapter.markov_kernel)
    assert [drafter_kind(n).default_scheduler for n in ("dspark", "dflash", "eagle3")] == [
        "adaptive", "fixed", "fixed"]


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"unknown drafter kind.*'medusa'.*dspark"):
        adapter_for("medusa")
    tiny = DecoderConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8)
    with pytest.raises(ConfigError, match=r"model_type.*'medusa'"):
        DraftConfig(target=tiny, model_type="medusa")


def test_a_proposal_reads_by_field_and_by_name():
    p = Proposal.of({"tokens": jnp.ones((2, 3), jnp.int32), "probs": jnp.ones((2, 3, 5))})
    assert p["tokens"] is p.tokens and p.length is None
    np.testing.assert_array_equal(p.confidence, np.zeros((2, 3), np.float32))
    leaves = jax.tree.leaves(jax.jit(lambda q: q)(p))
    assert len(leaves) == 3                       # a pytree: the absent length is no leaf


# ----------------------------------------------------------------------------- a toy kind
def _toy_config_from_deepspec(raw: Mapping[str, Any], n_draft: int, vocab_size: int
                              ) -> dict[str, Any]:
    return dict(drafter_layouts.block_config_from_deepspec(raw, n_draft, vocab_size),
                model_type="toy")


TOY = dataclasses.replace(K.DFLASH, name="toy", deepspec_architectures=("Toy",),
                          config_from_deepspec=_toy_config_from_deepspec,
                          loss=Ref("dspark_jax.train.losses:DFLASH_LOSS"))


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(kind_registry._KINDS, "toy", TOY)
    return TOY


def test_a_toy_kind_is_one_record(toy, target, tmp_path):
    draft = init_draft(target, dict(BASE, model_type="toy"), seed=3)
    cfg = draft.config
    assert cfg.kind is toy and not cfg.has_markov and cfg.num_drafts == 4
    assert adapter_for("toy") is DSparkAdapter and loss_for(cfg) is DFLASH_LOSS
    draft.save(tmp_path / "d")
    back = load_draft(tmp_path / "d", target)
    assert back.config == cfg
    for a, b in zip(jax.tree.leaves(draft.state), jax.tree.leaves(back.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert json.loads((tmp_path / "d" / "config.json").read_text())["architectures"] == [
        "Qwen3ToyModel"]
    model = back.model
    cache = DSparkAdapter.init_cache(model, 2, 16)
    p = adapter_for("toy").propose(model, cache, jnp.asarray([3, 4]), jnp.asarray([0, 0]),
                                   jax.random.key(0), jnp.zeros((2, 1)),
                                   lambda k, probs: jnp.argmax(probs, -1))
    assert isinstance(p, Proposal) and p.tokens.shape == (2, 4)
    assert p.probs.shape == (2, 4, target.config.vocab_size)
