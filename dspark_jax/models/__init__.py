"""Models: target decoders (Llama/Qwen3), drafters (DSpark, DFlash, Eagle3), checkpoint I/O.

Stable public API: `load_target`, `load_draft`, `init_draft`.
"""

from dspark_jax.models.config import ConfigError, DecoderConfig, RopeConfig
from dspark_jax.models.target import Target, load_target

__all__ = ["ConfigError", "DecoderConfig", "RopeConfig", "Target", "load_target"]
