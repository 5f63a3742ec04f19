"""`speculative_generate`: lossless speculative decoding of a batch of prompts (SPEC §1; paper §2;
DeepSpec's evaluator's decoding loop and token-budget rule).

A thin wrapper over the serving engine (`serving.Engine`, which runs the one speculative round,
`decoding.speculative_round`) with one request slot per prompt, the whole batch verified in one
capacity bucket, and DeepSpec's protocol by default: every round verifies all γ drafts
(`scheduler="fixed"`) and rounds continue while DeepSpec's `while start < max_length` would
(`budget_rule="deepspec"`), so the rounds, their acceptance lengths and τ are DeepSpec's.
Its serving settings are one `EngineSettings` (`generation_settings` gives the protocol's).
Evaluation, calibration and `python -m dspark_jax.generate` decode through it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import numpy as np

from dspark_jax.decoding.autoregressive import pad_prompts
from dspark_jax.models.drafters.config import validate_against_target
from dspark_jax.serving.engine import Engine
from dspark_jax.serving.settings import EngineSettings, with_fields

_PREFILL_BUCKET = 256
_MAX_PREFILL_CHUNK = 8192


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Deprecated: pass `settings=generation_settings(verifier=...)` and `top_k`, `top_p`,
    `record_confidence` as keywords of `speculative_generate`. Given as its `settings`, a
    `SpecSettings` is read that way, with a `DeprecationWarning`."""

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
    # `proposed`/`accepted` (None when record_confidence is off)
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


def generation_settings(**fields: Any) -> EngineSettings:
    """`EngineSettings` for `speculative_generate`: DeepSpec's protocol (scheduler "fixed",
    budget_rule "deepspec") where `fields` say nothing else."""
    return EngineSettings(**{"scheduler": "fixed", "budget_rule": "deepspec", **fields})


def _from_spec_settings(spec: SpecSettings, sampling: dict[str, Any]) -> EngineSettings:
    """The `EngineSettings` of a `SpecSettings` given as `settings` (its top-k, top-p and
    `record_confidence` go to `sampling`), with a `DeprecationWarning` naming the call to write."""
    warnings.warn(f"speculative_generate(settings=SpecSettings(...)) is deprecated: pass "
                  f"settings=generation_settings(verifier={spec.verifier!r}), "
                  f"top_k={spec.top_k!r}, top_p={spec.top_p!r}, "
                  f"record_confidence={spec.record_confidence!r}",
                  DeprecationWarning, stacklevel=3)
    sampling.update(top_k=spec.top_k, top_p=spec.top_p, record_confidence=spec.record_confidence)
    return generation_settings(verifier=spec.verifier)


def speculative_generate(target: Any, draft: Any, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: int, settings: EngineSettings | None = None,
                         temperature: float = 0.0, seed: int = 0, top_k: int = 0,
                         top_p: float = 1.0, max_cache_len: int | None = None,
                         record_confidence: bool = True, progress: bool = False,
                         **fields: Any) -> SpecResult:
    """Speculative decoding of a batch of prompts (token-id lists); lossless w.r.t. the target.

    `settings`: the serving engine's settings (default `generation_settings()`: scheduler
    "fixed", which verifies all γ drafts as DeepSpec's evaluator, and DeepSpec's token-budget
    rule; any engine mode works; the target's layout is the engine's,
    `Target.decoding_layout`). One engine slot per prompt: `max_requests`, `max_len` and
    `prefill_chunk` come from the batch, and `capacity_buckets` (when None) is the whole
    batch's drafts. `max_cache_len`: the KV cache length (default: room for the longest
    prompt, the output and one verification of γ+1). `top_k` / `top_p`: every request's
    sampling (the target's and the drafter's distributions alike). `record_confidence`: return
    the confidence logits of every round. `progress`: a tqdm bar of the emitted tokens.
    Returns the generated ids per prompt and per-round statistics (proposed/accepted counts
    and acceptance lengths in DeepSpec's bookkeeping on stop tokens).

    Deprecated, kept for existing callers with a `DeprecationWarning` naming the call to
    write: `EngineSettings` fields as keywords (`speculative_generate(..., scheduler="none")`,
    read as `settings=generation_settings(scheduler="none")`, or as
    `dataclasses.replace(settings, ...)` beside `settings`), and a `SpecSettings` as
    `settings`. A keyword that is neither a parameter nor a field raises TypeError naming it.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be ≥ 1")
    sampling = {"top_k": top_k, "top_p": top_p, "record_confidence": record_confidence}
    if isinstance(settings, SpecSettings):
        settings = _from_spec_settings(settings, sampling)
    settings = with_fields(settings, fields, caller="speculative_generate",
                           default=generation_settings, spelled="generation_settings")
    check_compatible(target, draft)
    g = draft.config.num_drafts
    # validates the prompts; room for the prompt, the output and one verification of γ+1
    _, lens, cache_len = pad_prompts(prompts, target.config.vocab_size, max_cache_len,
                                     max_new_tokens + g + 1)
    R = len(prompts)
    # one prefill forward holds the longest prompt, rounded up to 256 tokens so batches of
    # similar prompts share one compiled prefill (padding tokens are masked)
    chunk = min(-(-int(max(lens)) // _PREFILL_BUCKET) * _PREFILL_BUCKET, _MAX_PREFILL_CHUNK)
    per_request = int(settings.tree_budget or g)   # drafts or tree nodes
    eng = Engine(target, draft, settings=dataclasses.replace(
        settings, max_requests=R, max_len=cache_len, prefill_chunk=chunk,
        capacity_buckets=settings.capacity_buckets or [R * (per_request + 1)]))
    res = eng.generate(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                       seed=seed, top_k=sampling["top_k"], top_p=sampling["top_p"],
                       progress=progress)
    per = res.per_request
    conf = None
    if sampling["record_confidence"]:
        conf = [np.asarray(p.confidence, np.float32).reshape(-1, g) for p in per]
    return SpecResult(tokens=res.tokens, proposed=[p.proposed for p in per],
                      accepted=[p.accepted for p in per],
                      rounds=sum(r.steps for r in res.rounds),
                      confidence=conf, acceptance=[p.acceptance for p in per])
