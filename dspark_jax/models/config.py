"""Target decoder configuration (SPEC §2: the frozen target model Mt).

One frozen dataclass covers the decoder family dspark_jax supports: Llama (SmolLM2, Llama 2/3),
Qwen3 (per-head q/k RMSNorm, head_dim independent of hidden/heads) and the dense Gemma4 text
models (the paper's cross-family target, Gemma4-12B): per-layer sliding/full attention with
per-type RoPE and head shapes, k=v attention, per-layer input embeddings, KV-shared layers and
final-logit softcapping. It is read from and written to Hugging Face `config.json` dictionaries
so checkpoints round-trip.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
}
FAMILIES = ("llama", "qwen3", "gemma4")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3", "proportional")


class ConfigError(ValueError):
    """An invalid or unsupported model configuration (names the field and the source)."""


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

    family: str  # "llama" | "qwen3" | "gemma4"
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
        if self.family == "gemma4" and not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        checks = {
            "family": self.family in FAMILIES,
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

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    # ------------------------------------------------------------------ per-layer shapes
    @property
    def is_gemma4(self) -> bool:
        return self.family == "gemma4"

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def attn_shape(self, layer_type: str) -> tuple[int, int]:
        """(kv heads, head dim) of a layer type (Gemma4 full layers use the global shape)."""
        if layer_type == "full_attention" and self.is_gemma4:
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
        if self.is_gemma4:
            return _gemma4_num_params(self)
        d, f, h, kv, hd = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                           self.num_key_value_heads, self.head_dim)
        per_layer = d * hd * (2 * h + 2 * kv) + 3 * d * f + 2 * d + (2 * hd if self.qk_norm else 0)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + d

    # ------------------------------------------------------------------ HF interop
    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], source: str = "config.json") -> "DecoderConfig":
        """Builds a config from a Hugging Face `config.json` dict; errors name `source`."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        family = None
        for a in archs:
            family = SUPPORTED_ARCHITECTURES.get(a, family)
        if family is None and model_type in ("llama", "qwen3"):
            family = model_type
        if family is None and str(model_type).startswith("gemma4"):
            family = "gemma4"
        if family == "gemma4":
            from dspark_jax.models.gemma4_config import gemma4_from_hf

            return gemma4_from_hf(cls, cfg, source)
        if family is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or model_type!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}")

        def need(key: str) -> Any:
            if key not in cfg:
                raise ConfigError(f"{source}: missing required field {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = cfg.get("head_dim") or hidden // heads
        return cls(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope_from_hf(cfg, source),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "llama")),
            qk_norm=family == "qwen3",
            attention_bias=bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=(tuple(cfg["eos_token_id"]) if isinstance(cfg.get("eos_token_id"), list)
                          else cfg.get("eos_token_id")),
            pad_token_id=cfg.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        if self.is_gemma4:
            from dspark_jax.models.gemma4_config import gemma4_to_hf

            return gemma4_to_hf(self)
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.family]
        rope_scaling = None
        if self.rope.rope_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": self.rope.factor}
        elif self.rope.rope_type == "llama3":
            rope_scaling = {
                "rope_type": "llama3", "factor": self.rope.factor,
                "low_freq_factor": self.rope.low_freq_factor,
                "high_freq_factor": self.rope.high_freq_factor,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
            }
        out = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        return out


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


def _gemma4_num_params(c: DecoderConfig) -> int:
    d, h = c.hidden_size, c.num_attention_heads
    total = c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + d
    p = c.hidden_size_per_layer_input
    if p:
        total += (c.vocab_size_per_layer_input or c.vocab_size) * c.num_hidden_layers * p
        total += d * c.num_hidden_layers * p + p
    for i in range(c.num_hidden_layers):
        t = c.layer_type(i)
        kv, hd = c.attn_shape(t)
        n = d * hd * 2 * h + hd + 4 * d + 3 * d * c.mlp_size(i) + 1
        if c.kv_producer(i) == i:
            n += d * hd * kv * (2 if c.has_v_proj(t) else 1) + hd
        if p:
            n += 2 * d * p + d
        total += n
    return total
