"""Target decoder configuration (SPEC §2: the frozen target model Mt).

One frozen dataclass covers the decoder families dspark_jax supports: Llama (SmolLM2, Llama 2/3),
Qwen3 (per-head q/k RMSNorm, head_dim independent of hidden/heads) and the dense Gemma4 text
models (the paper's cross-family target, Gemma4-12B): per-layer sliding/full attention with
per-type RoPE and head shapes, k=v attention, per-layer input embeddings, KV-shared layers and
final-logit softcapping. It is read from and written to Hugging Face `config.json` dictionaries
so checkpoints round-trip.

This module is the bottom of models/: it knows no family. What differs per family (the
`config.json` fields, the parameter count, the drafter's layers) is a `Family` record of
models/families.py, which imports the family modules, which import this one. So the methods
below that need their family look it up by name in the registry that families.py fills with
`register_family` when `dspark_jax.models` is imported (models/__init__.py imports it, and
Python runs that before any module of the package).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3", "proportional")


class ConfigError(ValueError):
    """An invalid or unsupported model configuration (names the field and the source)."""


# ----------------------------------------------------------------------------- family registry
_FAMILIES: dict[str, Any] = {}   # name → models.families.Family, in registration order


def register_family(family: Any) -> None:
    """Makes `family` (a models.families.Family) known to the config classes by its name."""
    _FAMILIES[family.name] = family


def family_spec(name: str) -> Any:
    """The registered models.families.Family called `name` (ConfigError naming the known ones)."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ConfigError(f"unknown model family {name!r}; known: {list(_FAMILIES)}") from None


def registered_families() -> tuple[Any, ...]:
    return tuple(_FAMILIES.values())


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base theta plus optional scaling ("default", "linear", "llama3")."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # "proportional" (Gemma4 full attention): only the first partial_rotary_factor·head_dim/2
    # frequency pairs rotate; the rest get frequency 0 (identity)
    partial_rotary_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shape and numerics of a Llama/Qwen3/Gemma4 decoder.

    For Gemma4, following Hugging Face, `head_dim` and `num_key_value_heads` are the base
    (sliding-layer) values and `global_head_dim` / `num_global_key_value_heads` override them on
    full-attention layers; `rope` is the full-attention RoPE and `sliding_rope` the sliding one.
    """

    family: str  # a registered family: "llama" | "qwen3" | "gemma4" (models/families.py)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # ---- Gemma4 (defaults leave Llama/Qwen3 unchanged)
    layer_types: tuple[str, ...] = ()          # () = every layer "full_attention"
    sliding_window: int | None = None
    sliding_rope: RopeConfig | None = None
    global_head_dim: int | None = None         # head_dim of full-attention layers
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False             # full layers: values = k_proj output (v-normed)
    hidden_size_per_layer_input: int = 0       # per-layer input embeddings (0 = off)
    vocab_size_per_layer_input: int | None = None
    num_kv_shared_layers: int = 0              # the last n layers reuse earlier layers' K/V
    use_double_wide_mlp: bool = False          # KV-shared layers get a 2× intermediate size
    hidden_act: str = "silu"                   # "silu" (SwiGLU) | "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        family = _FAMILIES.get(self.family)
        if family is not None and family.typed_layers and not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        checks = {
            "family": family is not None,
            "vocab_size": self.vocab_size > 0,
            "hidden_size": self.hidden_size > 0,
            "intermediate_size": self.intermediate_size > 0,
            "num_hidden_layers": self.num_hidden_layers > 0,
            "num_attention_heads": self.num_attention_heads > 0,
            "num_key_value_heads": self.num_key_value_heads > 0
            and self.num_attention_heads % max(self.num_key_value_heads, 1) == 0,
            "head_dim": self.head_dim > 0 and self.head_dim % 2 == 0,
            "rope.rope_type": self.rope.rope_type in ROPE_TYPES,
            # q/k/v/o biases (some Llama variants) are not supported; refuse rather than ignore
            "attention_bias": not self.attention_bias,
            "hidden_act": self.hidden_act in ("silu", "gelu_pytorch_tanh"),
            "layer_types": (not self.layer_types
                            or (len(self.layer_types) == self.num_hidden_layers
                                and all(t in LAYER_TYPES for t in self.layer_types))),
            "sliding_window": ("sliding_attention" not in self.layer_types
                               or (self.sliding_window or 0) > 0),
            "global_head_dim": self.global_head_dim is None or (
                self.global_head_dim > 0 and self.global_head_dim % 2 == 0),
            "num_global_key_value_heads": self.num_global_key_value_heads is None or (
                self.num_global_key_value_heads > 0
                and self.num_attention_heads % self.num_global_key_value_heads == 0),
            "num_kv_shared_layers": 0 <= self.num_kv_shared_layers < self.num_hidden_layers,
            "final_logit_softcapping": (self.final_logit_softcapping is None
                                        or self.final_logit_softcapping > 0),
            "hidden_size_per_layer_input": self.hidden_size_per_layer_input >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"invalid decoder config field {name!r}: {self}")

    # ------------------------------------------------------------------ per-layer shapes
    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def attn_shape(self, layer_type: str) -> tuple[int, int]:
        """(kv heads, head dim) of a layer type: full-attention layers take the global shape
        where one is set (Gemma4; None for the other families, whose layers share one shape)."""
        if layer_type == "full_attention":
            kv = self.num_global_key_value_heads or self.num_key_value_heads
            return kv, self.global_head_dim or self.head_dim
        return self.num_key_value_heads, self.head_dim

    def rope_for(self, layer_type: str) -> RopeConfig:
        if layer_type == "sliding_attention" and self.sliding_rope is not None:
            return self.sliding_rope
        return self.rope

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_producer(self, i: int) -> int:
        """The layer whose K/V layer i attends with: itself, or for a KV-shared layer the last
        non-shared layer of the same type (as Hugging Face's `kv_sharing_modes`)."""
        first = self.first_kv_shared_layer
        if i < first:
            return i
        t = self.layer_type(i)
        for j in range(first - 1, -1, -1):
            if self.layer_type(j) == t:
                return j
        raise ConfigError(f"num_kv_shared_layers={self.num_kv_shared_layers}: shared layer {i} "
                          f"({t}) has no earlier non-shared {t} layer to take K/V from")

    def mlp_size(self, i: int) -> int:
        wide = self.use_double_wide_mlp and i >= self.first_kv_shared_layer
        return self.intermediate_size * (2 if wide else 1)

    def has_v_proj(self, layer_type: str) -> bool:
        return not (self.attention_k_eq_v and layer_type == "full_attention")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def replace(self, **kw: Any) -> "DecoderConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        return family_spec(self.family).num_params(self)

    # ------------------------------------------------------------------ HF interop
    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "DecoderConfig":
        """Builds a config from a Hugging Face `config.json` dict; errors name `source`. The
        family is the one whose architectures (else model_type) the dict names."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        family = None
        for a in archs:
            family = next((f for f in _FAMILIES.values() if a in f.hf_architectures), family)
        if family is None:
            family = next((f for f in _FAMILIES.values() if f.claims_model_type(model_type)), None)
        if family is None:
            supported = sorted(a for f in _FAMILIES.values() for a in f.hf_architectures)
            raise ConfigError(
                f"{source}: unsupported architecture {archs or model_type!r}; supported: "
                f"{supported}")
        return family.config_from_hf(cls, cfg, source)

    def to_hf_dict(self) -> dict[str, Any]:
        return family_spec(self.family).config_to_hf(self)

    def draft_layer_config(self, num_layers: int, layer_family: str) -> "DecoderConfig":
        """The config of `num_layers` drafter layers of `layer_family` for this target (SPEC §3:
        the target's shapes; each family says which of its fields the draft layers keep)."""
        return family_spec(layer_family).draft_layer_config(self, num_layers)


def hf_shape_fields(c: DecoderConfig) -> dict[str, Any]:
    """The `config.json` fields every family writes for its base shapes (in that order)."""
    return {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
    }


def hf_token_fields(c: DecoderConfig) -> dict[str, Any]:
    """The `config.json` fields every family ends with: special token ids (a tuple of EOS ids
    as a JSON list) and `torch_dtype` (float32; the exporter overwrites it for bf16 weights)."""
    return {
        "bos_token_id": c.bos_token_id,
        "eos_token_id": (list(c.eos_token_id) if isinstance(c.eos_token_id, tuple)
                         else c.eos_token_id),
        "pad_token_id": c.pad_token_id,
        "torch_dtype": "float32",
    }


def rope_from_hf(cfg: Mapping[str, Any], source: str = "config.json") -> RopeConfig:
    """Reads RoPE from `rope_theta`/`rope_scaling` (transformers < 5) or `rope_parameters` (≥ 5)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: unsupported rope type {rope_type!r} "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    partial = float(merged.get("partial_rotary_factor", 1.0))
    if not 0.0 < partial <= 1.0:
        raise ConfigError(f"{source}: rope partial_rotary_factor {partial} outside (0, 1]")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", 8192)),
        partial_rotary_factor=partial,
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> list[float]:
    """Inverse frequencies [head_dim/2] with the configured scaling (host-side floats)."""
    inv = [1.0 / (rope.theta ** (2 * i / head_dim)) for i in range(head_dim // 2)]
    if rope.rope_type == "proportional":
        # Gemma4: exponents over the FULL head_dim, pairs past the rotated fraction stay still
        n_rot = int(rope.partial_rotary_factor * head_dim // 2)
        return [f / rope.factor if i < n_rot else 0.0 for i, f in enumerate(inv)]
    if rope.rope_type == "linear":
        inv = [f / rope.factor for f in inv]
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / rope.factor)
            else:
                smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
                    rope.high_freq_factor - rope.low_freq_factor)
                out.append((1 - smooth) * f / rope.factor + smooth * f)
        inv = out
    return inv
