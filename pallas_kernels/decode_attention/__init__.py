"""Attention of a few queries a row over a KV-cache prefix and the call's own new keys (the
target's attention while decoding, SPEC §1–2): `decode_attention`; oracle
`ref_decode_attention`."""

from pallas_kernels.decode_attention.kernel import (DEFAULT_BLOCK_K, decode_attention,
                                                    ref_decode_attention, splits_for)

__all__ = ["DEFAULT_BLOCK_K", "decode_attention", "ref_decode_attention", "splits_for"]
