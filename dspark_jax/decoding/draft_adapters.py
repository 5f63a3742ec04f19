"""Drafter adapters: how the speculative round drives each drafter model (SPEC §1 step 2; §3
inference: DSpark/DFlash parallel blocks; §5 inference: Eagle3's chain; DeepSpec's evaluator's
per-drafter `propose`). The drafter models themselves live in `dspark_jax.models`.

Every drafter kind's record (`DrafterKind.adapter`, models/drafter_kinds.py) names a
`DrafterAdapter`, which exposes the same pure functions to the round
(`decoding.speculative_round`), so DSpark, DFlash and Eagle3 run through one loop:
  init_cache(model, B, max_len)                       → draft cache
  grown_cache(cache, max_len)                         → the cache with room for max_len
  commit(model, cache, feats [B,T,n·d], start [B], count [B], next_tokens [B,T]) → cache
      (target features of newly committed tokens at positions start..start+count−1;
       next_tokens[t] is the token that follows position start+t — Eagle3 pairs them)
  propose(model, cache, anchor [B], anchor_pos [B], key, temperature, sample_fn,
          probs_fn=None, stop_ids=None)
      → Proposal(tokens [B,γ], probs [B,γ,V], confidence [B,γ], length [B] (with stop_ids))
  commit_ragged(model, cache, feats [K,n·d], slot [K], pos [K], valid [K], lengths [B],
                dense_idx [B,T], count [B], next_tokens [B,T]) → cache
      (the serving engine's flattened form: only the `valid` tokens' features are written)
and declares what else it offers as fields: `drafts_trees` (`propose_tree`, a draft tree per
request) and `markov_kernel` (`propose_with_uniforms`, the Markov sampling kernel, where
`supports_markov_kernel(model)` says the model's head fits it).
DSpark/DFlash cache the per-layer context K/V of committed features (context visible strictly
before the anchor; stale entries past it are overwritten before they become visible).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from dspark_jax.decoding.tree import DraftTree, grow_tree, markov_child_logits
from dspark_jax.models.decoder import grown_positions
from dspark_jax.models.drafters.dspark import DraftCache, DSparkDraft
from dspark_jax.models.drafters.kind import drafter_kind
from dspark_jax.models.layers import UnstackedLayers, cache_scatter


@flax.struct.dataclass
class Proposal:
    """A drafter's γ proposed tokens for every request (read by field, or by name as
    `proposal["tokens"]`)."""

    tokens: jax.Array                     # [B, γ] int32
    probs: jax.Array                      # [B, γ, V] the distributions they were drawn from
    confidence: jax.Array                 # [B, γ] confidence logits (zeros without a head)
    length: jax.Array | None = None       # [B] drafts up to and including a drafted stop token
    cache: Any = None                     # the drafter's cache as drafting left it (Eagle3's
    #                                       chain writes scratch K/V into it), or None

    def __getitem__(self, name: str) -> jax.Array | None:
        return getattr(self, name)

    @classmethod
    def of(cls, out: dict[str, jax.Array]) -> "Proposal":
        """From a model's proposal dict (confidence zeros where it has none)."""
        conf = out.get("confidence")
        if conf is None:
            conf = jnp.zeros(out["tokens"].shape, jnp.float32)
        return cls(tokens=out["tokens"], probs=out["probs"], confidence=conf,
                   length=out.get("length"), cache=out.get("cache"))


class DrafterAdapter:
    """What every adapter offers the round (module docstring); capabilities as fields."""

    drafts_trees: ClassVar[bool] = False      # `propose_tree`: a draft tree per request
    markov_kernel: ClassVar[bool] = False     # `propose_with_uniforms`: the Markov kernel

    @staticmethod
    def supports_markov_kernel(model: Any) -> bool:
        """Whether the Markov sampling kernel implements this model's head."""
        return False


def _grown_kv(cache: Any, max_len: int) -> Any:
    """A drafter cache whose k / v (stacked [Ld, B, S, K, H] or one [1, B, S, K, H] buffer a
    layer) have room for `max_len` ≥ S positions."""
    pad = lambda x: grown_positions(x, max_len)  # noqa: E731
    return cache.replace(k=jax.tree.map(pad, cache.k), v=jax.tree.map(pad, cache.v))


def _block_outputs(model: DSparkDraft, cache: DraftCache, anchor: jax.Array,
                   anchor_pos: jax.Array) -> jax.Array:
    """The block's draft-slot outputs [B, γ, D]: one backbone pass from the anchors over the
    context cached strictly before them."""
    return model.draft_slots(model.backbone_over_cache(anchor, anchor_pos, cache.k, cache.v))


def _chain_confidence(model: DSparkDraft, h: jax.Array, anchor: jax.Array,
                      tokens: jax.Array) -> jax.Array:
    """Confidence logits [B, γ] of a drafted chain `tokens` [B, γ] (slot k conditioned on the
    token before it); zeros without a confidence head."""
    if not model.cfg.has_confidence:
        return jnp.zeros(tokens.shape, jnp.float32)
    prev = jnp.concatenate([anchor[:, None].astype(jnp.int32), tokens[:, :-1]], axis=1)
    emb = model.markov.embed_prev(prev, h.dtype) if model.cfg.has_markov else None
    return model.confidence(h, emb)


class DSparkAdapter(DrafterAdapter):
    """DSpark (Markov/gated/RNN head + confidence) and DFlash (no sequential head)."""

    drafts_trees = True
    markov_kernel = True
    grown_cache = staticmethod(_grown_kv)

    @staticmethod
    def init_cache(model: DSparkDraft, batch: int, max_len: int) -> DraftCache:
        """An empty context cache: one buffer a draft layer for the decoding layout (each
        layer's attention reads its buffer where it lies), else stacked."""
        lc = model.cfg.layer_config()
        n = lc.num_hidden_layers
        shape = (batch, max_len, lc.num_key_value_heads, lc.head_dim)
        if isinstance(model.layers, UnstackedLayers):
            k, v = (tuple(jnp.zeros((1,) + shape, model.dtype) for _ in range(n))
                    for _ in range(2))
            return DraftCache(k=k, v=v)
        return DraftCache(k=jnp.zeros((n,) + shape, model.dtype),
                          v=jnp.zeros((n,) + shape, model.dtype))

    @staticmethod
    def commit(model: DSparkDraft, cache: DraftCache, feats: jax.Array, start: jax.Array,
               count: jax.Array, next_tokens: jax.Array) -> DraftCache:
        del count, next_tokens  # entries past the anchor stay invisible until overwritten
        B, T = feats.shape[:2]
        pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        k, v = model.context_kv(feats, pos)                      # [Ld, B, T, K, H]
        at = (jnp.arange(B)[:, None], pos)
        return DraftCache(k=cache_scatter(cache.k, at, k), v=cache_scatter(cache.v, at, v))

    @staticmethod
    def commit_ragged(model: DSparkDraft, cache: DraftCache, feats_kf: jax.Array,
                      slot_k: jax.Array, pos_k: jax.Array, valid_k: jax.Array,
                      lengths: jax.Array, dense_idx: jax.Array, count: jax.Array,
                      next_tokens: jax.Array) -> DraftCache:
        """Context K/V of the valid flattened tokens at (slot, position); the rest drop."""
        del lengths, dense_idx, count, next_tokens
        B = jax.tree.leaves(cache.k)[0].shape[1]
        k, v = model.write_context((cache.k, cache.v), jnp.where(valid_k, slot_k, B), pos_k,
                                   feats_kf)
        return DraftCache(k=k, v=v)

    @staticmethod
    def propose(model: DSparkDraft, cache: DraftCache, anchor: jax.Array,
                anchor_pos: jax.Array, key: jax.Array, temperature: jax.Array,
                sample_fn: Callable, probs_fn: Callable | None = None,
                stop_ids: jax.Array | None = None, vocab_weights: Any = None
                ) -> Proposal:
        """`vocab_weights`: `vocab_weights(model)`, gathered once per engine."""
        del stop_ids  # a parallel block has no chain to stop
        h = _block_outputs(model, cache, anchor, anchor_pos)                 # [B,γ,D]
        return Proposal.of(model.sample_block(h, anchor, key, temperature, sample_fn, probs_fn,
                                              vocab_weights=vocab_weights))

    @staticmethod
    def propose_tree(model: DSparkDraft, cache: DraftCache, anchor: jax.Array,
                     anchor_pos: jax.Array, keys: jax.Array, temperature: jax.Array,
                     top_k: jax.Array, top_p: jax.Array, *, budget: int, branching: int,
                     depth_limit: jax.Array | None = None, vocab_weights: Any = None
                     ) -> tuple[DraftTree, jax.Array]:
        """A draft tree of `budget` nodes a request (`decoding.tree.grow_tree`: one backbone
        pass, then the sequential head's bias per parent; DFlash branches on U alone), and the
        confidence logits [B, γ] of its chain. `keys` [B]: per-request keys; `depth_limit` [B]:
        no node deeper (a request's remaining budget)."""
        h = _block_outputs(model, cache, anchor, anchor_pos)                 # [B,γ,D]
        B = anchor.shape[0]
        ids = model.vocab_ids()
        if ids is not None and vocab_weights is None:
            vocab_weights = model.draft_vocab_weights()
        base = model.draft_vocab_logits(h, vocab_weights)                   # [B,γ,Vd]
        state0 = (model.markov.init_state((B,), h.dtype) if model.cfg.has_markov
                  else jnp.zeros((B, 1), h.dtype))
        tree = grow_tree(markov_child_logits(model, vocab_weights), h, base, anchor, state0,
                         keys, temperature, top_k, top_p, budget=budget, branching=branching,
                         depth_limit=depth_limit, vocab_ids=ids,
                         vocab_size=model.cfg.target.vocab_size)
        return tree, _chain_confidence(model, h, anchor, tree.tokens[:, :h.shape[1]])

    @staticmethod
    def vocab_weights(model: DSparkDraft) -> Any:
        """The draft vocabulary's weight rows (`DSparkDraft.draft_vocab_weights`) or None."""
        return model.draft_vocab_weights()

    @staticmethod
    def supports_markov_kernel(model: DSparkDraft) -> bool:
        """The Markov sampling kernel implements the vanilla head (logits = U + W2·W1[x])."""
        return model.cfg.has_markov and model.cfg.markov_head_type == "vanilla"

    @staticmethod
    def propose_with_uniforms(model: DSparkDraft, cache: DraftCache, anchor: jax.Array,
                              anchor_pos: jax.Array, uniforms: jax.Array,
                              temperature: jax.Array, markov_sample_fn: Callable
                              ) -> Proposal:
        """`propose` with the vanilla Markov head sampled by `markov_sample_fn(uniforms [B,γ],
        U [B,γ,V], W1, W2, anchor [B], T [B]) → (tokens, probs)` (the batched kernel or its
        oracle) instead of the model's per-slot scan. The drafter samples softmax(·/T) of its
        logits (no top-k/top-p: verification is lossless for any p_d it reports). The confidence
        head then runs on all slots at once from the sampled previous tokens."""
        h = _block_outputs(model, cache, anchor, anchor_pos)                 # [B,γ,D]
        base = model.base_logits(h)                                         # [B,γ,V] f32
        toks, probs = markov_sample_fn(uniforms, base, model.markov.w1.get_value(),
                                       model.markov.w2.get_value(), anchor.astype(jnp.int32),
                                       temperature)
        return Proposal(tokens=toks, probs=probs,
                        confidence=_chain_confidence(model, h, anchor, toks))


class Eagle3Adapter(DrafterAdapter):
    """Eagle3: a chain of γ autoregressive draft steps over its own KV cache (no Markov head:
    its chain samples step by step; no trees: a tree would cost a pass per level)."""

    grown_cache = staticmethod(_grown_kv)

    @staticmethod
    def vocab_weights(model: Any) -> None:
        """Nothing gathered ahead (its chain steps use the model's own head)."""
        return None

    @staticmethod
    def init_cache(model: Any, batch: int, max_len: int) -> Any:
        return model.init_cache(batch, max_len)

    @staticmethod
    def commit(model: Any, cache: Any, feats: jax.Array, start: jax.Array, count: jax.Array,
               next_tokens: jax.Array) -> Any:
        del start  # Eagle3's cache tracks its own committed length
        return model.commit(cache, feats, next_tokens, count)

    @staticmethod
    def commit_ragged(model: Any, cache: Any, feats_kf: jax.Array, slot_k: jax.Array,
                      pos_k: jax.Array, valid_k: jax.Array, lengths: jax.Array,
                      dense_idx: jax.Array, count: jax.Array, next_tokens: jax.Array) -> Any:
        """Eagle3 appends pairs in order per request: gather each request's run of flattened
        tokens (`dense_idx` [B, T]) into [B, T] and commit `count` of them at `lengths`."""
        del slot_k, pos_k, valid_k
        feats = feats_kf[jnp.clip(dense_idx, 0, feats_kf.shape[0] - 1)]       # [B,T,F]
        cache = cache.replace(lengths=lengths.astype(jnp.int32))
        return model.commit(cache, feats, next_tokens, count)

    @staticmethod
    def propose(model: Any, cache: Any, anchor: jax.Array, anchor_pos: jax.Array,
                key: jax.Array, temperature: jax.Array, sample_fn: Callable,
                probs_fn: Callable | None = None, stop_ids: jax.Array | None = None,
                vocab_weights: Any = None) -> Proposal:
        del anchor, anchor_pos, vocab_weights  # the last committed pair ends with the anchor
        return Proposal.of(model.propose(cache, key, temperature, model.cfg.num_drafts,
                                         sample_fn, probs_fn=probs_fn, stop_ids=stop_ids))


def adapter_for(model_type: str) -> type[DrafterAdapter]:
    """The adapter of the drafter kind `model_type` (`DrafterKind.adapter`); a ConfigError
    naming the known kinds for any other."""
    adapter = drafter_kind(model_type).adapter.load()
    if not (isinstance(adapter, type) and issubclass(adapter, DrafterAdapter)):
        raise TypeError(f"drafter kind {model_type!r}: its adapter {adapter!r} is not a "
                        "DrafterAdapter")
    return adapter
