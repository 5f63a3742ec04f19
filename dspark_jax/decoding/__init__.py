"""Decoding: plain autoregressive generation and the lossless speculative loop (SPEC §1, §8)."""

from dspark_jax.decoding.autoregressive import autoregressive_generate
from dspark_jax.decoding.speculative import SpecResult, SpecSettings, speculative_generate

__all__ = ["SpecResult", "SpecSettings", "autoregressive_generate", "speculative_generate"]
