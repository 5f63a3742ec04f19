"""Deprecated alias of `dspark_jax.decoding.draft_adapters` (drafter adapters, SPEC §1 step 2),
kept only for `dspark_jax/aot/decode.py` until it imports the new name; then delete this file."""

from dspark_jax.decoding.draft_adapters import DSparkAdapter, Eagle3Adapter, adapter_for

__all__ = ["DSparkAdapter", "Eagle3Adapter", "adapter_for"]
