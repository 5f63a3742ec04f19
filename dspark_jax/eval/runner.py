"""The one offline evaluation driver: DeepSpec's offline evaluation protocol (SPEC §6; DeepSpec's
evaluator) around `serving.speculative_generate`. `evaluate` (τ, throughput, calibration
report) and `calibrate` (STS on held-out rounds) both decode through it.

What it implements:

* the prompts (:func:`prepare`): DeepSpec's prompt files `<data_dir>/<name>.jsonl`
  (`{"turns": [...]}` records) and its seeded subsampling (`data.prompts.load_eval_dataset`),
  the first turn only, rendered with the chat template with the generation prompt on and
  thinking disabled (`data.chat.render_prompt`); a prompt that cannot hold max_new_tokens and
  one verification of γ + 1 under the cache limit is skipped and its id recorded, not decoded;
* the decoding (:func:`decode`): prompts sorted by length, decoded in batches through the
  serving engine with one cache length for the whole run (:func:`cache_length`, rounded up to
  a bucket of 64, so the rounds compile once per batch size; `speculative_generate` sizes the
  prefill chunk by each batch's prompt total, so the prefill compiles once per distinct
  total), a seed per batch from the caller's rule, and per prompt the generated ids with
  DeepSpec's per-round proposal length, accepted drafts and acceptance length, plus the
  confidence logits of every round; the wall time and the XLA compilation time in it
  (`jax.monitoring`). :func:`decode_autoregressive` runs the same batches with plain
  decoding (the baseline of the speedup).

What the numbers mean is `eval.acceptance` and `eval.calibration`; the files an evaluation
writes, and reading them back, are `eval.results`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from dspark_jax.data.prompts import Conversation, list_eval_datasets, load_eval_dataset

if TYPE_CHECKING:
    from dspark_jax.serving.settings import EngineSettings

__all__ = ["EvalDatasetError", "CACHE_BUCKET", "PreparedDataset", "PromptOutput", "Decoded",
           "CompileTimer", "Progress", "check_settings", "resolve_datasets", "fits", "prepare",
           "cache_length", "length_batches", "decode", "decode_autoregressive"]

#: Cache lengths are rounded up to a multiple of this (fewer distinct shapes to compile).
CACHE_BUCKET = 64


class EvalDatasetError(FileNotFoundError, ValueError):
    """Requested prompt files are not in the data directory (the message lists what is there).

    A `FileNotFoundError` (the file is not there) and a `ValueError` (a bad argument)."""


# ------------------------------------------------------------------------------------------
# prompts
# ------------------------------------------------------------------------------------------

def check_settings(max_new_tokens: int, batch_size: int, temperature: float) -> None:
    """`ValueError` naming the first bad run setting."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0, got {temperature}")


def resolve_datasets(data_dir: str | Path, datasets: Sequence[str] | str | None,
                     default: Sequence[str] | None = None) -> list[str]:
    """The dataset names to evaluate, each a `<data_dir>/<name>.jsonl` that exists.

    `datasets`: names, or one comma-separated string; None = `default` ∩ what is there, in
    `default`'s order (`default` None: every file there). Duplicates are dropped.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise EvalDatasetError(f"data directory {str(data_dir)!r} does not exist")
    available = list_eval_datasets(data_dir)
    if datasets is None:
        if default is None:
            if not available:
                raise EvalDatasetError(f"no <name>.jsonl prompt files in {str(data_dir)!r}")
            return available
        chosen = [d for d in default if d in available]
        if not chosen:
            raise EvalDatasetError(
                f"none of the DeepSpec datasets {list(default)} is in {str(data_dir)!r}; "
                f"available: {available}; pass datasets=[...] (--datasets)")
        return chosen
    if isinstance(datasets, str):
        datasets = [d for d in datasets.split(",") if d.strip()]
    chosen = [str(d).strip() for d in datasets]
    if not chosen:
        raise EvalDatasetError(f"no datasets given; available in {str(data_dir)!r}: {available}")
    missing = [d for d in chosen if d not in available]
    if missing:
        raise EvalDatasetError(f"datasets {missing} not found in {str(data_dir)!r}; "
                               f"available: {available}")
    return list(dict.fromkeys(chosen))


@dataclasses.dataclass(frozen=True)
class PreparedDataset:
    """One dataset's prompts: every loaded conversation, its rendered ids, and which fit."""

    name: str
    convs: list[Conversation]
    ids: list[list[int]]   # rendered prompt of every conversation
    keep: list[int]        # indices into convs that fit the cache limit (decoded)
    skipped: list[int]     # indices that do not (counted, not decoded)

    @property
    def prompts(self) -> list[list[int]]:
        """The prompts to decode, in the order of `keep`."""
        return [self.ids[i] for i in self.keep]

    @property
    def skipped_ids(self) -> list[str]:
        return [self.convs[i].id for i in self.skipped]


def fits(prompt_len: int, max_new_tokens: int, gamma: int, limit: int) -> bool:
    """Room for the prompt, the output and one verification of γ + 1 under the cache limit."""
    return prompt_len + max_new_tokens + gamma + 1 <= limit


def prepare(data_dir: str | Path, names: Sequence[str], tokenizer: Any, *,
            max_samples: Mapping[str, int | None], seed: int, max_new_tokens: int, gamma: int,
            limit: int, system_prompt: str | None = None,
            enable_thinking: bool = False) -> dict[str, PreparedDataset]:
    """Loads, subsamples (`max_samples[name]`, None = all; seeded) and renders every dataset's
    first turns; prompts that do not fit `limit` are recorded as skipped."""
    from dspark_jax.data.chat import render_prompt

    out: dict[str, PreparedDataset] = {}
    for name in names:
        convs = load_eval_dataset(data_dir, name, max_samples[name], seed=seed,
                                  first_turn_only=True)
        ids = [render_prompt(c.messages, tokenizer, system_prompt=system_prompt,
                             enable_thinking=enable_thinking).tolist() for c in convs]
        ok = [fits(len(p), max_new_tokens, gamma, limit) for p in ids]
        out[name] = PreparedDataset(name, convs, ids, keep=[i for i, f in enumerate(ok) if f],
                                    skipped=[i for i, f in enumerate(ok) if not f])
    return out


def cache_length(prompt_lens: Sequence[int], max_new_tokens: int, gamma: int, limit: int) -> int:
    """One KV cache length for a whole run: the longest prompt, the output and a verification,
    rounded up to `CACHE_BUCKET` (at most `limit`)."""
    need = max(prompt_lens, default=1) + max_new_tokens + gamma + 2
    return min(limit, -(-need // CACHE_BUCKET) * CACHE_BUCKET)


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar prompt length (sorted, stable)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


# ------------------------------------------------------------------------------------------
# timing and progress
# ------------------------------------------------------------------------------------------

_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                   "/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")


class CompileTimer:
    """Sums the tracing/lowering/XLA-compile durations JAX reports while active."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def _listener(self, event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            self.seconds += float(duration)

    @contextlib.contextmanager
    def active(self) -> Iterator["CompileTimer"]:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listener)
        try:
            yield self
        finally:
            jax.monitoring.unregister_event_duration_listener(self._listener)


class Progress:
    """One tqdm bar over a run's prompts (`desc` + the dataset being decoded); a speculative
    run shows the run's tokens/s and the dataset's τ so far."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        self.desc = desc
        self.bar = tqdm(total=total, desc=desc, unit="sample", disable=not enabled,
                        dynamic_ncols=True)
        self.tokens, self.seconds = 0, 0.0

    def dataset(self, name: str) -> None:
        self.bar.set_description(f"{self.desc} {name}")

    def batch(self, prompts: int, tokens: int, seconds: float, tau: float | None) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.bar.update(prompts)
        if tau is not None:
            self.bar.set_postfix(tok_s=f"{self.tokens / max(self.seconds, 1e-9):.1f}",
                                 tau=f"{tau:.2f}")

    def close(self) -> None:
        self.bar.close()


# ------------------------------------------------------------------------------------------
# decoding
# ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class PromptOutput:
    """What one decoded prompt produced; the per-round lists align (empty for plain decoding)."""

    tokens: list[int]
    proposed: list[int] = dataclasses.field(default_factory=list)    # drafts verified
    accepted: list[int] = dataclasses.field(default_factory=list)    # drafts accepted
    acceptance: list[int] = dataclasses.field(default_factory=list)  # DeepSpec's length
    confidence: np.ndarray | None = None  # [rounds, γ] f32 logits (drafters with the head)


@dataclasses.dataclass
class Decoded:
    """`outputs[i]` belongs to `prompts[i]`; `order` is the decoding order (batch by batch)."""

    outputs: list[PromptOutput]
    order: list[int]
    wall_s: float
    compile_s: float


def _batched(prompts: Sequence[Sequence[int]], batch_size: int,
             run_batch: Callable[[list[Sequence[int]], int], list[PromptOutput]],
             progress: Progress | None, tau: Callable[[], float | None]) -> Decoded:
    outputs: list[PromptOutput | None] = [None] * len(prompts)
    batches = length_batches([len(p) for p in prompts], batch_size)
    wall = 0.0
    timer = CompileTimer()
    with timer.active():
        for b, batch in enumerate(batches):
            t0 = time.perf_counter()
            outs = run_batch([prompts[i] for i in batch], b)
            dt = time.perf_counter() - t0
            wall += dt
            for i, o in zip(batch, outs):
                outputs[i] = o
            if progress is not None:
                progress.batch(len(batch), sum(len(o.tokens) for o in outs), dt, tau())
    return Decoded(outputs=outputs,  # type: ignore[arg-type]  (every index was filled)
                   order=[i for batch in batches for i in batch], wall_s=wall,
                   compile_s=timer.seconds)


def decode(target: Any, draft: Any, prompts: Sequence[Sequence[int]], *, batch_size: int,
           batch_seed: Callable[[int], int], max_new_tokens: int, temperature: float,
           cache_len: int, settings: EngineSettings | None = None,
           record_confidence: bool = True, progress: Progress | None = None) -> Decoded:
    """Speculative decoding of `prompts` (token-id lists) in length-sorted batches of
    `batch_size`; batch b (in decoding order) samples with seed `batch_seed(b)`. `settings`:
    the serving engine's (`serving.generation_settings()` by default: DeepSpec's protocol;
    draft trees with `tree_budget` > 0). `record_confidence`: whether confidence rows come
    back.
    """
    from dspark_jax.serving.generation import speculative_generate

    gamma = int(draft.config.num_drafts)
    committed = rounds = 0

    def run_batch(batch: list[Sequence[int]], b: int) -> list[PromptOutput]:
        nonlocal committed, rounds
        res = speculative_generate(target, draft, batch, max_new_tokens=max_new_tokens,
                                   settings=settings, temperature=temperature,
                                   seed=batch_seed(b), max_cache_len=cache_len,
                                   record_confidence=record_confidence)
        outs = []
        for j in range(len(batch)):
            alen = (res.acceptance[j] if res.acceptance is not None
                    else [a + 1 for a in res.accepted[j]])
            conf = (None if res.confidence is None
                    else np.asarray(res.confidence[j], np.float32).reshape(-1, gamma))
            outs.append(PromptOutput(tokens=res.tokens[j], proposed=res.proposed[j],
                                     accepted=res.accepted[j], acceptance=list(alen),
                                     confidence=conf))
            committed += sum(alen)
            rounds += len(res.accepted[j])
        return outs

    return _batched(prompts, batch_size, run_batch, progress,
                    lambda: committed / rounds if rounds else float("nan"))


def decode_autoregressive(target: Any, prompts: Sequence[Sequence[int]], *, batch_size: int,
                          batch_seed: Callable[[int], int], max_new_tokens: int,
                          temperature: float, cache_len: int,
                          stop_token_ids: Sequence[int] | None = None,
                          progress: Progress | None = None) -> Decoded:
    """The same batches decoded by the target alone (`decoding.autoregressive`): the baseline."""
    from dspark_jax.decoding.autoregressive import autoregressive_generate

    def run_batch(batch: list[Sequence[int]], b: int) -> list[PromptOutput]:
        toks = autoregressive_generate(target, batch, max_new_tokens=max_new_tokens,
                                       temperature=temperature, seed=batch_seed(b),
                                       stop_token_ids=stop_token_ids, max_cache_len=cache_len)
        return [PromptOutput(tokens=t) for t in toks]

    return _batched(prompts, batch_size, run_batch, progress, lambda: None)
