"""The drafter kinds (SPEC §3 DSpark and DFlash, SPEC §5 Eagle3), one `DrafterKind` record each
(models/drafters/kind.py says what a record holds), registered on import.

Adding a kind is adding a record here, its NNX module, its serving adapter
(decoding/draft_adapters.py) and its training loss (a `DrafterLoss` in train/); the code that
serves, trains, exports and loads drafters asks the record.
"""

from __future__ import annotations

from typing import Any

from dspark_jax.models.drafters.dspark import DSparkDraft
from dspark_jax.models.drafters.eagle3 import Eagle3Draft
from dspark_jax.models.drafters.kind import DrafterKind, Ref, register_drafter_kind
from dspark_jax.models.io import drafter_layouts as layouts


def block_recipe(d: Any, *, heads: bool, draft_layers: int, markov_rank: int,
                 num_anchors: int) -> None:
    """DeepSpec's DSpark recipe (`heads`: `draft_layers` layers, block 7, vanilla Markov head of
    `markov_rank`, confidence head fed the Markov embedding, CE 0.1 + L1 0.9, loss decay γ 4)
    or DFlash's (the same backbone without the Markov and confidence heads, CE only)."""
    d.num_draft_layers = draft_layers
    d.block_size = 7
    d.num_anchors = num_anchors
    d.loss_decay_gamma = 4.0
    if heads:
        d.markov_rank = markov_rank
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


def dspark_recipe(d: Any, *, draft_layers: int, markov_rank: int, num_anchors: int) -> None:
    block_recipe(d, heads=True, draft_layers=draft_layers, markov_rank=markov_rank,
                 num_anchors=num_anchors)


def dflash_recipe(d: Any, *, draft_layers: int, markov_rank: int, num_anchors: int) -> None:
    block_recipe(d, heads=False, draft_layers=draft_layers, markov_rank=markov_rank,
                 num_anchors=num_anchors)


def eagle3_recipe(d: Any, *, draft_layers: int, markov_rank: int, num_anchors: int) -> None:
    """DeepSpec's Eagle3 recipe: one layer, training-time test of length 7, step loss decay
    0.8 (the sizes a config scales do not apply)."""
    del draft_layers, markov_rank, num_anchors
    d.draft_num_hidden_layers = 1
    d.ttt_length = 7
    d.step_loss_decay = 0.8
    d.markov_rank = 0
    d.enable_confidence_head = False
    d.confidence_head_alpha = 0.0


_BLOCK_LAYOUT = dict(
    parallel_block=True, layers_field="num_draft_layers", gamma_field="block_size",
    init_from_target=True, deepspec_architectures=("DSpark", "DFlash"), deepspec_aliases=(),
    deepspec_fields=layouts.DSPARK_FIELDS, deepspec_config=layouts.block_deepspec_config,
    config_from_deepspec=layouts.block_config_from_deepspec, tensor_aliases=(),
    attn_in_dim=layouts.no_attn_in_dim, tensor_names=layouts.block_tensor_names,
    pure_from_tensors=layouts.block_pure_from_tensors,
    tensors_from_pure=layouts.block_tensors_from_pure, pruned_vocab_format="speculators",
    speculators_exportable=True, adapter=Ref("dspark_jax.decoding.draft_adapters:DSparkAdapter"))

DSPARK = register_drafter_kind(DrafterKind(
    name="dspark", module=DSparkDraft, sequential_heads=True, recipe=dspark_recipe,
    loss=Ref("dspark_jax.train.losses:DSPARK_LOSS"), default_scheduler="adaptive",
    **_BLOCK_LAYOUT))
DFLASH = register_drafter_kind(DrafterKind(
    name="dflash", module=DSparkDraft, sequential_heads=False, recipe=dflash_recipe,
    loss=Ref("dspark_jax.train.losses:DFLASH_LOSS"), default_scheduler="fixed",
    **_BLOCK_LAYOUT))
EAGLE3 = register_drafter_kind(DrafterKind(
    name="eagle3", module=Eagle3Draft, parallel_block=False, sequential_heads=False,
    layers_field="draft_num_hidden_layers", gamma_field="ttt_length", init_from_target=False,
    recipe=eagle3_recipe, deepspec_architectures=("Eagle3",),
    deepspec_aliases=("Eagle3DraftModel",),   # SpecForge's; DeepSpec's eval.py maps it too
    deepspec_fields=layouts.EAGLE3_FIELDS, deepspec_config=layouts.chain_deepspec_config,
    config_from_deepspec=layouts.chain_config_from_deepspec,
    tensor_aliases=(("midlayer.", "layers.0."),), attn_in_dim=layouts.chain_attn_in_dim,
    tensor_names=layouts.chain_tensor_names, pure_from_tensors=layouts.chain_pure_from_tensors,
    tensors_from_pure=layouts.chain_tensors_from_pure, pruned_vocab_format="eagle3",
    speculators_exportable=False,
    adapter=Ref("dspark_jax.decoding.draft_adapters:Eagle3Adapter"),
    loss=Ref("dspark_jax.train.eagle3_loss:EAGLE3_LOSS"), default_scheduler="fixed"))

__all__ = ["DSPARK", "DFLASH", "EAGLE3", "block_recipe"]
