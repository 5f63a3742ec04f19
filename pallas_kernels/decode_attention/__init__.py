"""Attention of a few queries a row over a KV-cache prefix and the call's own new keys (the
target's attention while decoding, SPEC §1–2): `decode_attention` (own keys apart, any mask)
and `layer_attention` (from a layer's raw q/k/v product: q/k norms, RoPE, causal own keys and
their write into the cache, all in the kernel); oracles `ref_decode_attention`,
`ref_layer_attention`."""

from pallas_kernels.decode_attention.kernel import (DEFAULT_BLOCK_K, decode_attention,
                                                    layer_attention, ref_decode_attention,
                                                    ref_layer_attention, splits_for)

__all__ = ["DEFAULT_BLOCK_K", "decode_attention", "layer_attention", "ref_decode_attention",
           "ref_layer_attention", "splits_for"]
