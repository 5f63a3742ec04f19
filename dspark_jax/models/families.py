"""What differs between model families, as data: one `Family` record per family (SPEC §2 targets
Llama / Qwen3 / Gemma4; SPEC §3, §5 the drafters DeepSpec builds for them).

A family is named by `DecoderConfig.family` (a target's) or `DraftConfig.layer_family` (a
drafter's layers). Code that depends on the family asks its record here — `family_of(cfg)` or
`family(name)` — instead of testing the name, so adding a family is adding a record:

- Hugging Face `config.json` ⇄ DecoderConfig, and the parameter count (models/config.py reaches
  these by name through `register_family`, since the family modules import it);
- the target decoder's layers: their parameters, forward, ragged verification forward and KV
  cache (models/decoder.py);
- a target's Hugging Face layer tensors ⇄ its layer parameters (models/io/hf.py, which maps
  the embeddings, final norm and LM head, named alike by every family, itself);
- the drafters for its targets: which layer families they may use, the draft layers' config,
  the NNX drafter classes (models/drafters/draft.py);
- DeepSpec's drafter checkpoints: the architecture prefix (`Qwen3DSparkModel`), the base of
  config.json, the draft layers read back from it, their tensor names (models/io/deepspec.py).

Llama and Qwen3 share their code (models/llama/): Qwen3 is Llama plus q/k RMSNorm. Gemma4 is
models/gemma4/.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

from dspark_jax.models.config import DecoderConfig, family_spec, register_family
from dspark_jax.models.drafters.dspark import DSparkDraft
from dspark_jax.models.drafters.eagle3 import Eagle3Draft
from dspark_jax.models.gemma4 import config as gemma4_config
from dspark_jax.models.gemma4 import decoder as gemma4_decoder
from dspark_jax.models.gemma4 import drafters as gemma4_drafters
from dspark_jax.models.gemma4 import hf_tensors as gemma4_tensors
from dspark_jax.models.llama import config as llama_config
from dspark_jax.models.llama import decoder as llama_decoder
from dspark_jax.models.llama import hf_tensors as llama_tensors


@dataclasses.dataclass(frozen=True, eq=False)   # compared and hashed by identity
class Family:
    """Everything dspark_jax does differently for one model family."""

    name: str
    # ---- Hugging Face config.json (SPEC §2)
    hf_architectures: tuple[str, ...]            # `architectures` entries naming the family
    claims_model_type: Callable[[Any], bool]     # else: does `model_type` name it?
    config_from_hf: Callable[..., DecoderConfig]  # (cls, config.json dict, source) → config
    config_to_hf: Callable[[DecoderConfig], dict[str, Any]]
    num_params: Callable[[DecoderConfig], int]
    typed_layers: bool                           # layer_types always listed (() → all full)
    # ---- the target decoder (models/decoder.py)
    scale_embeddings: bool                       # token embeddings × √D
    make_stack: Callable[..., Any]               # (cfg, rngs=, param_dtype=) → layers module
    init_kv: Callable[..., Any]                  # (cfg, batch, max_len, dtype, num_layers
                                                 #  [, per_layer]) → k, v
    forward: Callable[..., Any]                  # the layers over a [B, T] batch
    ragged_forward: Callable[..., Any]           # the layers over K flattened tokens
    defers_writes: bool                          # forward / ragged_forward (grid calls) can
                                                 # leave the cache read-only
    # ---- a target's Hugging Face tensors (models/io/hf.py maps the embeddings, final norm and
    #      LM head, which every family names alike; the family its layers)
    target_prefix: Callable[[Mapping[str, Any], str], str]  # (tensors, source) → "model."
    target_from_hf: Callable[..., dict[str, Any]]  # (tensors, prefix, cfg, source) → layers
    target_to_hf: Callable[..., dict[str, Any]]    # (layers, cfg) → "model.layers.…" tensors
    # ---- drafters (SPEC §3, §5)
    draft_layer_families: tuple[str, ...]        # layer families its targets' drafters may use
    draft_layer_config: Callable[[DecoderConfig, int], DecoderConfig]  # (target, n) → layers
    drafter_classes: Mapping[str, type]          # DraftConfig.model_type → NNX module class
                                                 #  (a kind not listed: `DrafterKind.module`)
    legacy_draft_layers: bool                    # only legacy dspark_jax exports have them
    # ---- DeepSpec drafter checkpoints (models/io/deepspec.py)
    deepspec_prefix: str                         # "Qwen3" of Qwen3DSparkModel
    deepspec_base_config: Callable[[Any], dict[str, Any]]  # DraftConfig → config.json base
    deepspec_layer_config: Callable[[Mapping[str, Any], str], DecoderConfig]
    check_draft_shapes: Callable[[DecoderConfig, DecoderConfig, str], None]
    layer_tensor_names: Callable[..., list[str]]  # (layer config, i, attn_in_dim) → names
    import_layers: Callable[..., dict[str, Any]]  # (tensors, prefix, cfg, source, attn_in_dim)
    export_layers: Callable[..., dict[str, Any]]  # (stacked, prefix, cfg) → tensors


def _llama_like(name: str, architecture: str, deepspec_prefix: str, legacy_draft_layers: bool
                ) -> Family:
    """Llama and Qwen3: the same layers (Qwen3's q/k norms are `DecoderConfig.qk_norm`)."""
    return Family(
        name=name,
        hf_architectures=(architecture,),
        claims_model_type=functools.partial(llama_config.claims_model_type, family=name),
        config_from_hf=functools.partial(llama_config.config_from_hf, family=name),
        config_to_hf=llama_config.config_to_hf,
        num_params=llama_config.num_params,
        typed_layers=False,
        scale_embeddings=False,
        make_stack=llama_decoder.make_stack,
        init_kv=llama_decoder.init_kv,
        forward=llama_decoder.forward,
        ragged_forward=llama_decoder.ragged_forward,
        defers_writes=True,
        target_prefix=llama_tensors.target_prefix,
        target_from_hf=llama_tensors.target_layers_from_hf,
        target_to_hf=llama_tensors.target_layers_to_hf,
        draft_layer_families=("qwen3", "llama"),
        draft_layer_config=functools.partial(llama_config.draft_layer_config, family=name),
        drafter_classes={"dspark": DSparkDraft, "dflash": DSparkDraft, "eagle3": Eagle3Draft},
        legacy_draft_layers=legacy_draft_layers,
        deepspec_prefix=deepspec_prefix,
        deepspec_base_config=llama_config.deepspec_base_config,
        deepspec_layer_config=functools.partial(llama_config.deepspec_layer_config,
                                                family=name),
        check_draft_shapes=llama_config.check_draft_shapes,
        layer_tensor_names=llama_tensors.layer_tensor_names,
        import_layers=llama_tensors.import_all_layers,
        export_layers=llama_tensors.export_all_layers,
    )


# Llama-layer drafters (no q/k norm) predate the Qwen3 draft layers every consumer builds
LLAMA = _llama_like("llama", "LlamaForCausalLM", "Llama", legacy_draft_layers=True)
QWEN3 = _llama_like("qwen3", "Qwen3ForCausalLM", "Qwen3", legacy_draft_layers=False)
GEMMA4 = Family(
    name="gemma4",
    hf_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    claims_model_type=gemma4_config.claims_model_type,
    config_from_hf=gemma4_config.gemma4_from_hf,
    config_to_hf=gemma4_config.gemma4_to_hf,
    num_params=gemma4_config.num_params,
    typed_layers=True,
    scale_embeddings=True,
    make_stack=gemma4_decoder.make_stack,
    init_kv=gemma4_decoder.init_kv,
    forward=gemma4_decoder.forward,
    ragged_forward=gemma4_decoder.ragged_forward,
    defers_writes=False,
    target_prefix=gemma4_tensors.text_prefix,
    target_from_hf=gemma4_tensors.target_layers_from_hf,
    target_to_hf=gemma4_tensors.target_layers_to_hf,
    draft_layer_families=("gemma4",),
    draft_layer_config=gemma4_drafters.gemma4_draft_layer_config,
    drafter_classes={"dspark": gemma4_drafters.Gemma4DSparkDraft,
                     "dflash": gemma4_drafters.Gemma4DSparkDraft,
                     "eagle3": gemma4_drafters.Gemma4Eagle3Draft},
    legacy_draft_layers=False,
    deepspec_prefix="Gemma4",
    deepspec_base_config=gemma4_drafters.deepspec_base_config,
    deepspec_layer_config=gemma4_drafters.layer_shape_from_deepspec,
    check_draft_shapes=gemma4_drafters.check_draft_shapes,
    layer_tensor_names=gemma4_tensors.layer_tensor_names,
    import_layers=gemma4_tensors.import_all_layers,
    export_layers=gemma4_tensors.export_all_layers,
)

for _f in (LLAMA, QWEN3, GEMMA4):
    register_family(_f)

FAMILIES: Mapping[str, Family] = {f.name: f for f in (LLAMA, QWEN3, GEMMA4)}


def family(name: str) -> Family:
    """The family called `name` (ConfigError naming the known ones)."""
    return family_spec(name)


def family_of(cfg: DecoderConfig) -> Family:
    """The family of a target (or draft-layer) config."""
    return family_spec(cfg.family)


def family_by_deepspec_prefix(prefix: str) -> Family | None:
    """The family whose DeepSpec drafter architectures start with `prefix` ("Qwen3", …)."""
    return next((f for f in FAMILIES.values() if f.deepspec_prefix == prefix), None)


__all__ = ["Family", "FAMILIES", "LLAMA", "QWEN3", "GEMMA4", "family", "family_of",
           "family_by_deepspec_prefix"]
