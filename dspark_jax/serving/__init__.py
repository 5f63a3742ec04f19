"""Serving: the continuous-batching speculative decoding engine with load-aware verification
(paper §3.2.2, §5.2–5.4; SPEC §8, §9)."""

from dspark_jax.serving.engine import Engine, EngineResult

__all__ = ["Engine", "EngineResult"]
