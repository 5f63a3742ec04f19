"""Serving: the host side of speculative decoding (paper §3.2.2, §5.2–5.4; SPEC §8, §9): the
continuous-batching engine (`engine`, its settings in `settings`), its drafting policy (`policy`), the verification cost
profile (`cost_profile`) and `speculative_generate` (`generation`)."""

from dspark_jax.serving.engine import Engine, EngineResult, Request
from dspark_jax.serving.generation import (SpecResult, SpecSettings, check_compatible,
                                           generation_settings, speculative_generate)
from dspark_jax.serving.settings import EngineSettings

__all__ = ["Engine", "EngineResult", "EngineSettings", "Request", "SpecResult", "SpecSettings",
           "check_compatible", "generation_settings", "speculative_generate"]
