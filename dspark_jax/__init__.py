"""dspark_jax: DSpark speculative decoding and DeepSpec-style draft training in JAX/Flax."""

from dspark_jax.huge_pages import restart_with_huge_pages as _restart_with_huge_pages

__version__ = "0.1.0"

_restart_with_huge_pages()   # `python -m dspark_jax.…` only (dspark_jax/huge_pages.py)
