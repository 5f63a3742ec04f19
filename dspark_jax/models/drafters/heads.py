"""DSpark's sequential heads and confidence head (SPEC §3, paper §3.2–3.3).

The parallel backbone gives base logits U_k for every slot at once; the sequential head adds a
low-rank bias that depends on the previous token x_{k−1} (and, for the RNN head, on a state
carried left to right), so sampling is sequential but each step costs only O(r·V).
Parameters use DeepSpec's layouts ([V, r] for both Markov matrices, torch Linear [out, in]).
Initialisation is DeepSpec's `post_init` (`_init_weights`): every Linear and Embedding weight
N(0, initializer_range = 0.02), biases zero — W2 included (a zero W2 would leave W1 without a
gradient at step 0).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.layers import param


class MarkovHead(nnx.Module):
    """vanilla / gated / rnn sequential head of rank r."""

    def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
        V, D, r = cfg.target.vocab_size, cfg.target.hidden_size, cfg.markov_rank
        self.kind = cfg.markov_head_type
        self.rank = r
        self.w1 = param(rngs, (V, r), ("vocab", "rank"), param_dtype)   # embedding of x_{k−1}
        self.w2 = param(rngs, (V, r), ("vocab", "rank"), param_dtype)   # Linear r → V
        if self.kind == "gated":
            self.gate_w = param(rngs, (r, D + r), ("rank", "embed"), param_dtype)
            self.gate_b = param(None, (r,), ("rank",), param_dtype, "zeros")
        elif self.kind == "rnn":
            self.joint_w = param(rngs, (3 * r, 2 * r + D), ("rank", "embed"), param_dtype)
            self.joint_b = param(None, (3 * r,), ("rank",), param_dtype, "zeros")

    def init_state(self, batch_shape: tuple[int, ...], dtype: Any) -> jax.Array:
        return jnp.zeros(batch_shape + (self.rank,), dtype)

    def embed_prev(self, prev_tokens: jax.Array, dtype: Any) -> jax.Array:
        return jnp.take(self.w1.get_value(), prev_tokens, axis=0).astype(dtype)

    def step(self, h_d: jax.Array, prev_tok: jax.Array, state_r: jax.Array,
             rows: jax.Array | None = None, w2_rows: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
        """One slot: h [..., D], x_{k−1} [...], s_{k−1} [..., r] → (bias [..., V] f32, s_k);
        `rows` [K] (a pruned draft vocabulary): the bias of those tokens only, [..., K], from
        `w2_rows` = w2[rows] when the caller gathered them already."""
        z, state_r = self.project(h_d, prev_tok, state_r)
        return self.bias(z, rows, w2_rows), state_r

    def bias(self, z_r: jax.Array, rows: jax.Array | None = None,
             w2_rows: jax.Array | None = None) -> jax.Array:
        """The bias z·W2ᵀ [..., V] f32 of projections z [..., r] (`step`'s `rows`, `w2_rows`)."""
        w2 = self.w2.get_value()
        if w2_rows is not None:
            w2 = w2_rows
        elif rows is not None:
            w2 = jnp.take(w2, rows, axis=0)
        return jnp.einsum("...R,VR->...V", z_r, w2.astype(z_r.dtype),
                          preferred_element_type=jnp.float32)

    def project(self, h_d: jax.Array, prev_tok: jax.Array, state_r: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
        """One slot's rank-r projection z [..., r] (the bias is z·W2ᵀ) and s_k: h [..., D],
        x_{k−1} [...], s_{k−1} [..., r]."""
        dtype = h_d.dtype
        e = self.embed_prev(prev_tok, dtype)                               # [..., r]
        if self.kind == "vanilla":
            z = e
        elif self.kind == "gated":
            gate_in = jnp.concatenate([h_d, e], axis=-1)
            g = jax.nn.sigmoid(jnp.einsum("...I,RI->...R", gate_in,
                                          self.gate_w.get_value().astype(dtype))
                               + self.gate_b.get_value().astype(dtype))
            z = g * e
        else:  # rnn
            joint_in = jnp.concatenate([state_r, e, h_d], axis=-1)
            j = (jnp.einsum("...I,RI->...R", joint_in, self.joint_w.get_value().astype(dtype))
                 + self.joint_b.get_value().astype(dtype))
            gate, cand, out = jnp.split(j, 3, axis=-1)
            sg = jax.nn.sigmoid(gate)
            state_r = sg * state_r + (1.0 - sg) * jnp.tanh(cand)
            z = jnp.tanh(out)
        return z, state_r

    def teacher_forced(self, h_btd: jax.Array, prev_bt: jax.Array,
                       rows: jax.Array | None = None) -> jax.Array:
        """Biases [..., γ, V] (or [..., γ, K] on `rows`) for all slots with ground-truth previous
        tokens (training). h [..., γ, D] and prev [..., γ]; the RNN state is carried over γ.
        """
        if self.kind != "rnn":
            bias, _ = self.step(h_btd, prev_bt, jnp.zeros(h_btd.shape[:-1] + (self.rank,),
                                                          h_btd.dtype), rows)
            return bias
        h_first = jnp.moveaxis(h_btd, -2, 0)
        p_first = jnp.moveaxis(prev_bt, -1, 0)
        s0 = self.init_state(h_btd.shape[:-2], h_btd.dtype)

        def body(s, xs):
            h, p = xs
            b, s = self.step(h, p, s, rows)
            return s, b

        _, biases = jax.lax.scan(body, s0, (h_first, p_first))
        return jnp.moveaxis(biases, 0, -2)


class ConfidenceHead(nnx.Module):
    """c_k = Linear([h_k ; W1[x_{k−1}]]) → 1 (or of h_k alone)."""

    def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs, param_dtype: Any = jnp.float32):
        D = cfg.target.hidden_size
        self.with_markov = cfg.confidence_head_with_markov and cfg.has_markov
        width = D + (cfg.markov_rank if self.with_markov else 0)
        self.w = param(rngs, (1, width), (None, "embed"), param_dtype)
        self.b = param(None, (1,), (None,), param_dtype, "zeros")

    def __call__(self, h_d: jax.Array, prev_emb_r: jax.Array | None) -> jax.Array:
        x = h_d if not self.with_markov else jnp.concatenate([h_d, prev_emb_r], axis=-1)
        out = jnp.einsum("...I,OI->...O", x, self.w.get_value().astype(x.dtype),
                         preferred_element_type=jnp.float32)
        return (out + self.b.get_value().astype(jnp.float32))[..., 0]
