"""Re-export of `dspark_jax.sampling` (the helpers live below both models and decoding)."""

from dspark_jax.sampling import (filter_logits, filter_logits_rows, filtered_probs,
                                 probs_from_logits, sample_logits, sample_probs)

__all__ = ["filter_logits", "filter_logits_rows", "filtered_probs", "probs_from_logits",
           "sample_logits", "sample_probs"]
