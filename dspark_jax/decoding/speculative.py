"""The lossless, static-shape, on-device speculative decoding loop (SPEC §1; paper §2, §5).

One round, for a batch of requests at different lengths:
  1. the drafter proposes γ tokens after the anchor x0 (its context cache holds the target
     features of all committed tokens);
  2. ONE target pass over [x0, x1..xγ] at per-request positions extends the target KV cache and
     yields p_t,0..p_t,γ plus the hidden-state taps of those positions;
  3. rejection sampling (decoding/acceptance_rule.py, replaceable by a Pallas kernel) accepts a prefix
     of the first ℓ drafts (ℓ from a per-request verification mask — the scheduler's seam) and
     samples a correction or bonus token;
  4. commit by moving lengths: the anchor and accepted drafts stay in the target cache, their
     features go to the draft context; rejected entries are simply overwritten later.
`spec_loop` runs rounds in a `lax.while_loop` with no host round trip (the round benchmark
times it); `spec_step` runs one round per call. `speculative_generate` is a thin wrapper over
the serving engine (`dspark_jax.serving.Engine`: ragged verification, schedulers, continuous
batching), so evaluation and serving decode through the same code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.autoregressive import pad_prompts
from dspark_jax.decoding.stops import is_stop, stop_array
from dspark_jax.decoding.draft_adapters import adapter_for
from dspark_jax.decoding.sampling import probs_from_logits, sample_logits, sample_probs
from dspark_jax.models.decoder import KVCache, init_cache
from dspark_jax.models.draft_config import validate_against_target


@flax.struct.dataclass
class SpecState:
    cache: KVCache            # target cache; lengths = committed tokens before the anchor
    draft_cache: Any
    anchor: jax.Array         # [B] last committed token (not yet in the target cache)
    out: jax.Array            # [B, max_new] emitted tokens
    num_out: jax.Array        # [B]
    done: jax.Array           # [B] bool
    key: jax.Array
    rounds: jax.Array         # [] rounds run
    proposed: jax.Array       # [R_max, B] drafts verified per round (−1: request inactive)
    accepted: jax.Array       # [R_max, B] drafts accepted per round
    confidence: jax.Array     # [R_max, B, γ] confidence logits of the proposals


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Static settings of a compiled engine."""

    top_k: int = 0
    top_p: float = 1.0
    verifier: str = "jax"
    record_confidence: bool = True


def full_verify_mask(active: jax.Array, gamma: int) -> jax.Array:
    return jnp.broadcast_to(active[:, None], (active.shape[0], gamma))


def verify_len_from_mask(mask: jax.Array) -> jax.Array:
    """ℓ per request: the length of the leading run of True (pruned slots end the prefix)."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _prefill(target_gd: Any, draft_gd: Any, target_state: Any, draft_state: Any,
             tokens: jax.Array, lens: jax.Array, key: jax.Array, temperature: jax.Array,
             stop_ids: jax.Array, *, cache_len: int, max_new: int, max_rounds: int,
             settings: SpecSettings) -> SpecState:
    target = nnx.merge(target_gd, target_state)
    draft = nnx.merge(draft_gd, draft_state)
    cfg = draft.cfg
    adapter = adapter_for(cfg.model_type)
    B, P = tokens.shape
    cache = init_cache(target.cfg, B, cache_len, target.dtype)
    out = target(tokens, cache=cache, tap_layer_ids=cfg.target_layer_ids)
    last_h = out.hidden[jnp.arange(B), lens - 1]
    key, sub = jax.random.split(key)
    anchor = sample_logits(sub, target.logits(last_h), temperature, settings.top_k,
                           settings.top_p)
    # the draft context: features of prompt positions 0..len−1 (next token of position t is
    # tokens[t+1], and the anchor for the last prompt position)
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    nxt = jnp.where(jnp.arange(P)[None] == (lens - 1)[:, None], anchor[:, None], nxt)
    dcache = adapter.init_cache(draft, B, cache_len)
    dcache = adapter.commit(draft, dcache, out.taps, jnp.zeros((B,), jnp.int32), lens, nxt)
    buf = jnp.full((B, max_new), -1, jnp.int32).at[:, 0].set(anchor)
    g = cfg.num_drafts
    return SpecState(cache=out.cache.with_lengths(lens), draft_cache=dcache, anchor=anchor,
                     out=buf, num_out=jnp.ones((B,), jnp.int32),
                     done=is_stop(anchor, stop_ids) | (max_new <= 1), key=key,
                     rounds=jnp.zeros((), jnp.int32),
                     proposed=jnp.full((max_rounds, B), -1, jnp.int32),
                     accepted=jnp.full((max_rounds, B), -1, jnp.int32),
                     confidence=jnp.zeros((max_rounds if settings.record_confidence else 1, B, g),
                                          jnp.float32))


def _round(target: Any, draft: Any, s: SpecState, verify_mask: jax.Array,
           temperature: jax.Array, stop_ids: jax.Array, settings: SpecSettings) -> SpecState:
    """One speculative round for every active request (inactive rows are left unchanged)."""
    from dspark_jax.decoding.acceptance_rule import pallas_verify, rejection_verify

    cfg = draft.cfg
    adapter = adapter_for(cfg.model_type)
    g = cfg.num_drafts
    B, max_new = s.out.shape
    active = ~s.done
    anchor_pos = s.cache.lengths
    key, k_draft, k_verify = jax.random.split(s.key, 3)

    # 1. draft γ tokens
    prop = adapter.propose(draft, s.draft_cache, s.anchor, anchor_pos, k_draft, temperature,
                           sample_probs)
    drafts, draft_probs = prop["tokens"], prop["probs"]                   # [B,γ], [B,γ,V]

    # 2. one target pass over [anchor, drafts]
    seq = jnp.concatenate([s.anchor[:, None], drafts], axis=1)            # [B,γ+1]
    tout = target(seq, cache=s.cache, tap_layer_ids=cfg.target_layer_ids)
    target_probs = probs_from_logits(target.logits(tout.hidden), temperature)

    # 3. verification of the first ℓ drafts
    ell = jnp.where(active, verify_len_from_mask(verify_mask), 0)
    res = (pallas_verify if settings.verifier == "pallas" else rejection_verify)(k_verify, target_probs, draft_probs, drafts, ell)
    n_acc = res.num_accepted                                              # [B]

    # 4. emitted tokens: accepted drafts then the correction/bonus token; cut after a stop
    #    token among them and at the max_new budget
    j = jnp.arange(g + 1)
    cand = jnp.where(j[None] < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                     res.next_token[:, None])                             # [B,γ+1]
    n_emit = n_acc + 1
    stop_hit = is_stop(cand, stop_ids) & (j[None] < n_emit[:, None])
    first_stop = jnp.argmax(stop_hit, axis=1)
    any_stop = jnp.any(stop_hit, axis=1)
    n_emit = jnp.where(any_stop, first_stop + 1, n_emit)
    budget = max_new - s.num_out
    n_emit = jnp.minimum(n_emit, budget)
    n_emit = jnp.where(active, n_emit, 0)
    write_pos = s.num_out[:, None] + j[None]
    write = (j[None] < n_emit[:, None])
    b_idx = jnp.arange(B)[:, None]
    out = s.out.at[b_idx, jnp.where(write, write_pos, max_new)].set(cand, mode="drop")
    num_out = s.num_out + n_emit
    done = s.done | (active & (any_stop | (num_out >= max_new)))

    # 5. commit: the anchor + accepted drafts enter the target cache; the next anchor is the
    #    correction/bonus token. Rows that finished keep their state (nothing more is read).
    n_commit = jnp.where(active, n_acc + 1, 0)
    new_lengths = anchor_pos + n_commit
    next_tokens = jnp.where(j[None] < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                            res.next_token[:, None])
    # finished rows commit nothing (count 0); DSpark's writes past their anchor stay invisible
    dcache = adapter.commit(draft, s.draft_cache, tout.taps, anchor_pos, n_commit, next_tokens)
    r = jnp.minimum(s.rounds, s.proposed.shape[0] - 1)
    conf = s.confidence
    if settings.record_confidence:
        conf = conf.at[r].set(prop["confidence"].astype(jnp.float32))
    return SpecState(
        cache=tout.cache.with_lengths(new_lengths), draft_cache=dcache,
        anchor=jnp.where(active, res.next_token, s.anchor), out=out, num_out=num_out,
        done=done, key=key, rounds=s.rounds + 1,
        proposed=s.proposed.at[r].set(jnp.where(active, ell, -1)),
        accepted=s.accepted.at[r].set(jnp.where(active, n_acc, -1)),
        confidence=conf)


def default_policy(conf: jax.Array, active: jax.Array, gamma: int) -> jax.Array:
    return full_verify_mask(active, gamma)


@functools.partial(jax.jit, static_argnames=("target_gd", "draft_gd", "cache_len", "max_new",
                                             "max_rounds", "settings"))
def spec_prefill(target_gd, draft_gd, target_state, draft_state, tokens, lens, key, temperature,
                 stop_ids, *, cache_len: int, max_new: int, max_rounds: int,
                 settings: SpecSettings) -> SpecState:
    return _prefill(target_gd, draft_gd, target_state, draft_state, tokens, lens, key,
                    temperature, stop_ids, cache_len=cache_len, max_new=max_new,
                    max_rounds=max_rounds, settings=settings)


@functools.partial(jax.jit, static_argnames=("target_gd", "draft_gd", "settings"),
                   donate_argnames=("s",))
def spec_step(target_gd, draft_gd, target_state, draft_state, s: SpecState,
              verify_mask: jax.Array, temperature, stop_ids, *, settings: SpecSettings
              ) -> SpecState:
    """Host-stepped mode: exactly one round (the caller chooses the verification mask)."""
    target = nnx.merge(target_gd, target_state)
    draft = nnx.merge(draft_gd, draft_state)
    return _round(target, draft, s, verify_mask, temperature, stop_ids, settings)


@functools.partial(jax.jit, static_argnames=("target_gd", "draft_gd", "settings", "policy"),
                   donate_argnames=("s",))
def spec_loop(target_gd, draft_gd, target_state, draft_state, s: SpecState, temperature,
              stop_ids, *, settings: SpecSettings, policy: Callable = default_policy,
              num_rounds: int | jax.Array = 1 << 30) -> SpecState:
    """Rounds on device until every request is done (or `num_rounds` more rounds ran; traced,
    so changing it does not recompile)."""
    target = nnx.merge(target_gd, target_state)
    draft = nnx.merge(draft_gd, draft_state)
    g = draft.cfg.num_drafts
    start = s.rounds

    def cond(s: SpecState):
        return jnp.any(~s.done) & (s.rounds - start < num_rounds)

    def body(s: SpecState) -> SpecState:
        r = jnp.maximum(s.rounds - 1, 0)
        mask = policy(s.confidence[jnp.minimum(r, s.confidence.shape[0] - 1)], ~s.done, g)
        return _round(target, draft, s, mask, temperature, stop_ids, settings)

    return jax.lax.while_loop(cond, body, s)


@dataclasses.dataclass
class SpecResult:
    tokens: list[list[int]]                 # generated ids per prompt (prompt excluded)
    proposed: list[list[int]]               # per request, per round: drafts verified
    accepted: list[list[int]]               # per request, per round: drafts accepted
    rounds: int
    # per request, [its rounds, γ] float32 confidence-head logits of the proposals, aligned with
    # `proposed`/`accepted` (None when SpecSettings.record_confidence is off)
    confidence: list[np.ndarray] | None = None
    # per request, per round: DeepSpec's acceptance length (accepted+1; eos_pos+1 on a round
    # whose accepted drafts hold a stop token). None: accepted+1 everywhere
    acceptance: list[list[int]] | None = None

    @property
    def tau(self) -> float:
        """DeepSpec's pooled accepted length Σ(acceptance)/#rounds over all requests."""
        n = sum(len(a) for a in self.accepted)
        if self.acceptance is not None:
            return sum(x for a in self.acceptance for x in a) / max(n, 1)
        return sum(x + 1 for a in self.accepted for x in a) / max(n, 1)


def check_compatible(target: Any, draft: Any) -> None:
    validate_against_target(draft.config, target.config, source="draft")


def speculative_generate(target: Any, draft: Any, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                         stop_token_ids: Sequence[int] | None = None,
                         max_cache_len: int | None = None, settings: SpecSettings | None = None,
                         policy: Callable = default_policy, rounds_per_call: int | None = None,
                         progress: bool = False, scheduler: str = "fixed",
                         **engine_kw: Any) -> SpecResult:
    """Speculative decoding of a batch of prompts (token-id lists); lossless w.r.t. the target.

    A thin wrapper over `dspark_jax.serving.Engine` with one slot per prompt (`scheduler`
    "fixed" verifies all γ drafts, as DeepSpec's evaluator; any engine mode works) and
    DeepSpec's token-budget rule (`Engine(budget_rule="deepspec")`). Returns the generated ids
    per prompt and per-round statistics (proposed/accepted counts and acceptance lengths in
    DeepSpec's bookkeeping on stop tokens). `policy` and `rounds_per_call` belong to the
    on-device loop (`spec_loop`) and are ignored here; `progress` is accepted for
    compatibility.
    """
    del policy, rounds_per_call, progress
    from dspark_jax.serving import Engine

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be ≥ 1")
    check_compatible(target, draft)
    settings = settings or SpecSettings()
    cfg = target.config
    g = draft.config.num_drafts
    # validates the prompts; room for the prompt, the output and one verification of γ+1
    _, lens, cache_len = pad_prompts(prompts, cfg.vocab_size, max_cache_len,
                                     max_new_tokens + g + 1)
    R = len(prompts)
    # DeepSpec's protocol: every round verifies γ drafts, also near the token budget, and
    # rounds continue while DeepSpec's `while start < max_length` would
    kw = dict(capacity_buckets=[R * (g + 1)], prefill_chunk=int(min(sum(lens), 8192)),
              budget_rule="deepspec")
    kw.update(engine_kw)
    eng = Engine(target, draft, max_requests=R, max_len=cache_len, scheduler=scheduler,
                 verifier=settings.verifier, stop_token_ids=stop_token_ids, **kw)
    res = eng.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                       seed=seed, top_k=settings.top_k, top_p=settings.top_p)
    per = res.per_request
    conf = None
    if settings.record_confidence:
        conf = [np.asarray(p["confidence"], np.float32).reshape(-1, g) for p in per]
    return SpecResult(tokens=res.tokens, proposed=[p["proposed"] for p in per],
                      accepted=[p["accepted"] for p in per], rounds=len(res.rounds),
                      confidence=conf, acceptance=[p["acceptance"] for p in per])
