"""Flash attention of query rows over a shared context with a key limit per row (the context
half of DSpark's training-time block attention, SPEC §3): `context_attention`,
`context_attention_bwd`; oracle `ref_context_attention`."""

from pallas_kernels.context_attention.kernel import (DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q,
                                                     context_attention, context_attention_bwd,
                                                     ref_context_attention)

__all__ = ["DEFAULT_BLOCK_K", "DEFAULT_BLOCK_Q", "context_attention", "context_attention_bwd",
           "ref_context_attention"]
