"""Models (SPEC §2–5): target decoders (Llama/Qwen3/Gemma4), drafters (DSpark, DFlash, Eagle3)
and their checkpoint I/O.

Stable public API: `load_target`, `load_draft`, `init_draft`.

Layout (bottom to top; no module imports one above it): `config` (DecoderConfig) and `layers`;
the families `llama/` and `gemma4/`; `drafters/` (DraftConfig, the DSpark/DFlash/Eagle3
modules); `families` (the registry of what differs per family); `decoder` (TargetDecoder);
`io/` (checkpoints); `target` and `drafters.draft` (the public handles). See docs/ARCHITECTURE.md.
"""

# families first: importing it registers every family with models.config (see its docstring)
from dspark_jax.models import families  # noqa: F401
# … and importing drafter_kinds registers every drafter kind (models/drafters/kind.py)
from dspark_jax.models import drafter_kinds  # noqa: F401
from dspark_jax.models.config import ConfigError, DecoderConfig, RopeConfig
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.drafters.draft import Draft, init_draft, load_draft
from dspark_jax.models.target import Target, load_target

__all__ = ["ConfigError", "DecoderConfig", "Draft", "DraftConfig", "RopeConfig", "Target",
           "init_draft", "load_draft", "load_target"]
