"""Models: target decoders (Llama/Qwen3), drafters (DSpark, DFlash, Eagle3), checkpoint I/O.

Stable public API: `load_target`, `load_draft`, `init_draft`.
"""

from dspark_jax.models.config import ConfigError, DecoderConfig, RopeConfig
from dspark_jax.models.draft import Draft, init_draft, load_draft
from dspark_jax.models.draft_config import DraftConfig
from dspark_jax.models.target import Target, load_target

__all__ = ["ConfigError", "DecoderConfig", "Draft", "DraftConfig", "RopeConfig", "Target",
           "init_draft", "load_draft", "load_target"]
