"""`speculative_generate`: lossless speculative decoding of a batch of prompts (SPEC §1; paper §2;
DeepSpec's evaluator's decoding loop and token-budget rule).

A thin wrapper over the serving engine (`serving.Engine`, which runs the one speculative round,
`decoding.speculative_round`) with one request slot per prompt, the whole batch verified in one
capacity bucket, and DeepSpec's protocol by default: every round verifies all γ drafts
(`scheduler="fixed"`) and rounds continue while DeepSpec's `while start < max_length` would
(`budget_rule="deepspec"`), so the rounds, their acceptance lengths and τ are DeepSpec's.
Evaluation, calibration and `python -m dspark_jax.generate` decode through it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from dspark_jax.decoding.autoregressive import pad_prompts
from dspark_jax.models.drafters.config import validate_against_target
from dspark_jax.serving.engine import Engine

_PREFILL_BUCKET = 256
_MAX_PREFILL_CHUNK = 8192


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Sampling and verification settings of `speculative_generate`."""

    top_k: int = 0
    top_p: float = 1.0
    verifier: str = "jax"            # acceptance rule: "jax" or "pallas" (`acceptance_rule`)
    record_confidence: bool = True   # return the confidence logits of every round


@dataclasses.dataclass
class SpecResult:
    tokens: list[list[int]]                 # generated ids per prompt (prompt excluded)
    proposed: list[list[int]]               # per request, per round: drafts verified
    accepted: list[list[int]]               # per request, per round: drafts accepted
    rounds: int                             # engine rounds run (all requests together)
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
    """`ConfigError` when the drafter was built for another target (vocabulary, layers)."""
    validate_against_target(draft.config, target.config, source="draft")


def speculative_generate(target: Any, draft: Any, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                         stop_token_ids: Sequence[int] | None = None,
                         max_cache_len: int | None = None, settings: SpecSettings | None = None,
                         progress: bool = False, scheduler: str = "fixed",
                         **engine_kw: Any) -> SpecResult:
    """Speculative decoding of a batch of prompts (token-id lists); lossless w.r.t. the target.

    One engine slot per prompt; `scheduler` "fixed" verifies all γ drafts, as DeepSpec's
    evaluator (any engine mode works); `engine_kw` go to `Engine` (DeepSpec's token-budget rule
    `budget_rule="deepspec"` by default; the target's layout is the engine's,
    `Target.decoding_layout`).
    `max_cache_len`: the KV cache length (default: room for the longest prompt, the output and
    one verification of γ+1). `settings`: top-k / top-p (every request; the target's and the drafter's distributions alike), the verifier and
    whether confidences are recorded. `progress`: a tqdm bar of the emitted tokens. Returns the generated ids per prompt and per-round statistics
    (proposed/accepted counts and acceptance lengths in DeepSpec's bookkeeping on stop tokens).
    """
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
    # one prefill forward holds the longest prompt, rounded up to 256 tokens so batches of
    # similar prompts share one compiled prefill (padding tokens are masked)
    chunk = min(-(-int(max(lens)) // _PREFILL_BUCKET) * _PREFILL_BUCKET, _MAX_PREFILL_CHUNK)
    per_request = int(engine_kw.get("tree_budget") or g)   # drafts or tree nodes
    kw = dict(capacity_buckets=[R * (per_request + 1)], prefill_chunk=chunk,
              budget_rule="deepspec")
    kw.update(engine_kw)
    eng = Engine(target, draft, max_requests=R, max_len=cache_len, scheduler=scheduler,
                 verifier=settings.verifier, stop_token_ids=stop_token_ids, **kw)
    res = eng.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                       seed=seed, top_k=settings.top_k, top_p=settings.top_p,
                       progress=progress)
    per = res.per_request
    conf = None
    if settings.record_confidence:
        conf = [np.asarray(p["confidence"], np.float32).reshape(-1, g) for p in per]
    return SpecResult(tokens=res.tokens, proposed=[p["proposed"] for p in per],
                      accepted=[p["accepted"] for p in per],
                      rounds=sum(r["steps"] for r in res.rounds),
                      confidence=conf, acceptance=[p["acceptance"] for p in per])
