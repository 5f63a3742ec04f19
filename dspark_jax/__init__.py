"""dspark_jax: DSpark speculative decoding and DeepSpec-style draft training in JAX/Flax."""

__version__ = "0.1.0"
