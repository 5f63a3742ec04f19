"""Decoding: plain autoregressive generation and the lossless speculative loop (SPEC §1, §8)."""

from dspark_jax.decoding.autoregressive import autoregressive_generate

__all__ = ["autoregressive_generate"]
