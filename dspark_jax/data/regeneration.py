"""Regeneration of the training conversations by the target (DeepSpec's data recipe, SPEC §4).

DeepSpec trains drafters on conversations whose assistant turns were written by the target
itself, so the drafter learns the target's own distribution. For every conversation the user
turns are replayed in order: render the messages so far with the chat template and the
generation prompt (`chat.render_prompt`), sample a reply from the target (T = 0.7, top-p 0.8,
top-k 20 by default), append it as the assistant turn, continue with the next user turn. The
original assistant turns are discarded; system turns are kept where they were.

Batching (`engine`): "refill" (default) keeps `batch_size` slots busy on the serving engine's
plain decoding (`serving.Engine.serve`, scheduler "none"): when a reply ends, its slot goes to
the next queued request (the conversation's next turn is queued at once), several decode steps
run per device call and the cache grows in 64-token buckets, so steady state never recompiles.
"static" is the reference: conversations planned into fixed groups of `batch_size` (sorted by
number of user turns, then by first-prompt length), the k-th turns of a group generated
together by `decoding.autoregressive`, waiting for the group's slowest row. Finished
conversations are appended to the JSONL output with one write + flush + `os.fsync` per device
call that finished any (refill) or per group (static); both engines write the same records.

Resuming: on start the existing output is read, completed ids are skipped, and a torn last
line (a kill during the write) is truncated away; so a kill loses at most the conversations in
flight, and the output never holds an id twice. Every sampled token uses its own key,
`fold_in(key(hash(seed, id, turn)), token index)`, so a reply does not depend on its batch, its
row or when it ran, and a resumed run writes the text an uninterrupted run would (same settings).
The settings are stored beside the output (`<out>.regen.json`); resuming with different ones
(or with outputs of an older sampler, `SAMPLER_VERSION`) is refused.

Skips (counted in `RegenStats`, warned about, never fatal): conversations without a user turn,
duplicate ids (the first is kept), a first prompt longer than `max_prompt_tokens` (default: the
target's context minus `max_new_tokens`) or an empty first reply. A LATER turn that is too long
or gets an empty reply ends the conversation there (the completed turns are kept). An empty
input is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from dspark_jax.data.chat import render_prompt, with_system_prompt
from dspark_jax.data.prompt_sources import PROMPT_SOURCES, load_named_prompts
from dspark_jax.data.prompts import Conversation, Message, load_conversations, read_eval_file
from dspark_jax.decoding.autoregressive import ar_decode, pad_prompts, prefilled_state
from dspark_jax.decoding.stops import stop_array
from dspark_jax.serving import Engine, EngineSettings, Request

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.8
DEFAULT_TOP_K = 20
_STEPS_PER_CALL = 32
# Bumped when the tokens sampled for a (seed, id, turn) change: an output written by another
# sampler is not resumed (2: top-k draws among the k candidates, `autoregressive.sample_rows`).
SAMPLER_VERSION = 2


class RegenerationError(RuntimeError):
    """The output file cannot be resumed (corrupt line, foreign settings, concurrent writer)."""


@dataclasses.dataclass
class RegenStats:
    """What a `regenerate` call did. `written` counts records appended by this call."""

    conversations: int = 0
    already_done: int = 0
    written: int = 0
    duplicate_ids: int = 0
    skipped_no_user_turn: int = 0
    skipped_prompt_too_long: int = 0
    skipped_empty_reply: int = 0
    ended_early: int = 0          # a later turn was too long or got an empty reply
    turns_generated: int = 0
    replies_hit_max_new_tokens: int = 0
    generated_tokens: int = 0
    elapsed_s: float = 0.0
    # where the refill engine's time went (0 with the static engine): wall time of its prefill
    # (refills and cache grows) and decode device calls (first calls include compilation) and
    # the batched decode steps
    refill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def ms_per_decode_step(self) -> float:
        return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else 0.0


# ---------------------------------------------------------------- per-row sampling on device


def sample_key_data(seed: int, sample_id: str, turn: int) -> np.ndarray:
    """Threefry key data (uint32 [2]) of one reply: a hash of (seed, id, turn)."""
    digest = hashlib.blake2b(f"{seed}\x00{sample_id}\x00{turn}".encode("utf-8"), digest_size=8).digest()
    return np.frombuffer(digest, dtype=">u4").astype(np.uint32)


def generate_rows(target: Any, prompts: Sequence[np.ndarray], key_data: np.ndarray, *,
                  max_new_tokens: int, batch_size: int, temperature: float, top_k: int,
                  top_p: float, stop_token_ids: Sequence[int],
                  on_tokens: Callable[[int], None] | None = None) -> list[list[int]]:
    """Samples a reply per prompt (≤ batch_size prompts; the decoding rows padded to
    batch_size, the prompts prefilled in length groups). Row b uses `key_data[b]`."""
    n = len(prompts)
    if not 0 < n <= batch_size:
        raise ValueError(f"{n} prompts for a batch of {batch_size}")
    cfg = target.config
    _, _, cache_len = pad_prompts(list(prompts), cfg.vocab_size, None, max_new_tokens)
    active = np.arange(batch_size) < n
    keys = np.zeros((batch_size, 2), np.uint32)
    keys[:n] = key_data
    temp = jnp.asarray(temperature, jnp.float32)
    stops = stop_array(stop_token_ids, ())
    s = prefilled_state(target, prompts, keys, temp, stops, cache_len=cache_len,
                        max_new=max_new_tokens, top_k=top_k, top_p=top_p, rows=batch_size)
    counted = n
    if on_tokens is not None:
        on_tokens(n)
    stepper = target.decoding_layout()   # one buffer per decoder layer
    while not bool(jnp.all(s.done)):
        s = ar_decode(stepper.graphdef, stepper.state, s, temp, stops, num_steps=_STEPS_PER_CALL,
                      top_k=top_k, top_p=top_p)
        if on_tokens is not None:
            total = int(jnp.sum(jnp.where(jnp.asarray(active), s.num_out, 0)))
            on_tokens(total - counted)
            counted = total
    out, num = np.asarray(s.out), np.asarray(s.num_out)
    return [out[i, :num[i]].tolist() for i in range(n)]


# ---------------------------------------------------------------- output file (resume)


def scan_output(path: str | os.PathLike[str], *, truncate_torn: bool = True) -> set[str]:
    """Ids of the complete records in a regeneration output; a torn last line (no newline or
    unparseable) is cut off when `truncate_torn`. A bad line elsewhere raises RegenerationError."""
    path = Path(path)
    if not path.exists():
        return set()
    done: set[str] = set()
    good_end = 0           # byte offset just after the last good line
    bad_line: int | None = None
    torn = False
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, start=1):
            if bad_line is not None:  # the bad line was not the last one: real corruption
                raise RegenerationError(f"{path}:{bad_line}: not a regeneration record; refusing to resume")
            if not raw.endswith(b"\n"):  # only the last line can lack its newline
                torn = True
                break
            if not raw.strip():
                good_end += len(raw)
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
                bad_line = n
                continue
            if obj["id"] in done:
                raise RegenerationError(f"{path}:{n}: id {obj['id']!r} appears twice")
            done.add(obj["id"])
            good_end += len(raw)
    torn = torn or bad_line is not None
    if torn and truncate_torn:
        log.warning("%s: dropping a torn last line (%d bytes)", path, path.stat().st_size - good_end)
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
            fh.flush()
            os.fsync(fh.fileno())
    return done


def _check_settings(out_path: Path, settings: dict[str, Any]) -> None:
    meta = out_path.with_name(out_path.name + ".regen.json")
    if meta.exists():
        old = json.loads(meta.read_text(encoding="utf-8"))
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            raise RegenerationError(f"{out_path} was generated with other settings ({meta}): "
                                    f"{diff} (old, new); use the same settings or another --out")
        return
    tmp = meta.with_name(meta.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(settings, indent=1), encoding="utf-8")
    os.replace(tmp, meta)


# ---------------------------------------------------------------- the replay


@dataclasses.dataclass
class _Conv:
    id: str
    groups: list[list[Message]]    # before reply k: the system/user messages to append
    history: list[Message] = dataclasses.field(default_factory=list)
    alive: bool = True
    skipped: bool = False


def _turn_groups(messages: Sequence[Message]) -> list[list[Message]]:
    groups: list[list[Message]] = []
    pending: list[Message] = []
    for m in messages:
        if m["role"] == "assistant":
            continue
        pending.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            groups.append(pending)
            pending = []
    return groups


class _Replay:
    """The per-conversation state machine both engines drive: render turn k's prompt (or end
    the conversation when it is too long), take turn k's reply (or end it when empty)."""

    def __init__(self, tok: Any, stats: RegenStats, *, seed: int, limit: int, stops: list[int]):
        self.tok, self.stats, self.seed, self.limit = tok, stats, seed, limit
        self.stop_set = set(stops)

    def prompt(self, c: _Conv, k: int) -> np.ndarray | None:
        ids = render_prompt(c.history + c.groups[k], self.tok)
        if len(ids) > self.limit:
            _end(c, k, self.stats, "skipped_prompt_too_long")
            return None
        return np.asarray(ids, np.int32)

    def key(self, c: _Conv, k: int) -> np.ndarray:
        return sample_key_data(self.seed, c.id, k)

    def reply(self, c: _Conv, k: int, reply: list[int]) -> bool:
        """Records reply k; True when the conversation goes on with turn k + 1."""
        self.stats.turns_generated += 1
        self.stats.generated_tokens += len(reply)
        if reply and reply[-1] in self.stop_set:
            reply = reply[:-1]
        else:
            self.stats.replies_hit_max_new_tokens += 1
        text = self.tok.decode(reply)
        if not text.strip():
            _end(c, k, self.stats, "skipped_empty_reply")
            return False
        c.history = c.history + c.groups[k] + [{"role": "assistant", "content": text}]
        return k + 1 < len(c.groups)


ENGINES = ("refill", "static")


def regenerate(
    target: Any,
    conversations: Sequence[Conversation],
    out_path: str | os.PathLike[str],
    *,
    max_new_tokens: int,
    batch_size: int,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    top_k: int = DEFAULT_TOP_K,
    seed: int = 0,
    progress: bool = True,
    system_prompt: str | None = None,
    max_prompt_tokens: int | None = None,
    engine: str = "refill",
) -> RegenStats:
    """Replays every conversation's user turns through `target`, appending `{"id",
    "conversations"}` records to `out_path` (JSONL); resumes a partial output. See the module
    docstring for batching, determinism and skip rules. `system_prompt` is added to
    conversations without one (and stored in the record). `engine`: "refill" (continuous
    batching, the default) or "static" (fixed groups; the reference it must equal)."""
    t0 = time.perf_counter()
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not conversations:
        raise ValueError("no conversations to regenerate (empty prompt set)")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be >= 1")
    tok = target.tokenizer
    if tok is None:
        raise ValueError("the target has no tokenizer (needed to render prompts and decode replies)")
    cfg = target.config
    limit = cfg.max_position_embeddings - max_new_tokens if max_prompt_tokens is None else max_prompt_tokens
    if limit < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the "
                         f"target's context of {cfg.max_position_embeddings}")
    stops = list(getattr(tok, "stop_token_ids", None) or cfg.stop_token_ids)
    stats = RegenStats()

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    settings = {"target": getattr(target, "name", ""), "max_new_tokens": max_new_tokens,
                "batch_size": batch_size, "temperature": temperature, "top_p": top_p,
                "top_k": top_k, "seed": seed, "system_prompt": system_prompt,
                "max_prompt_tokens": limit, "sampler": SAMPLER_VERSION}
    with open(out_path, "ab") as out:
        try:
            fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RegenerationError(f"{out_path} is being written by another process") from None
        _check_settings(out_path, settings)
        done = scan_output(out_path)

        convs: list[_Conv] = []
        seen: set[str] = set()
        for c in conversations:
            if c.id in seen:
                stats.duplicate_ids += 1
                continue
            seen.add(c.id)
            groups = _turn_groups(with_system_prompt(c.messages, system_prompt))
            if not groups:
                stats.skipped_no_user_turn += 1
                continue
            convs.append(_Conv(c.id, groups))
        stats.conversations = len(convs)
        # The plan depends only on the input, never on what is done: resumed groups are identical.
        convs.sort(key=lambda c: (len(c.groups), sum(len(m["content"]) for m in c.groups[0])))
        stats.already_done = sum(c.id in done for c in convs)

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(convs), initial=stats.already_done, desc="regenerate", unit="conv")
        gen_t0 = time.perf_counter()
        finished: list[_Conv] = []

        def flush() -> None:
            """Appends the finished conversations with one write + fsync."""
            lines = [json.dumps({"id": c.id, "conversations": c.history}, ensure_ascii=False) + "\n"
                     for c in finished if not c.skipped and c.id not in done]
            if lines:
                out.write("".join(lines).encode("utf-8"))
                out.flush()
                os.fsync(out.fileno())
            stats.written += len(lines)
            done.update(c.id for c in finished)
            if bar is not None:
                rate = stats.generated_tokens / max(time.perf_counter() - gen_t0, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)
                bar.update(len(finished))
            for c in finished:
                c.history = []  # free the memory of written conversations
            finished.clear()

        replay = _Replay(tok, stats, seed=seed, limit=limit, stops=stops)
        kw = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
                  top_k=top_k, top_p=top_p, stops=stops)
        if engine == "refill":
            _run_refill(target, [c for c in convs if c.id not in done], replay, finished.append,
                        flush, limit=limit, **kw)
        else:
            _run_static(target, convs, done, replay, finished.append, flush, **kw)
        flush()
        if bar is not None:
            bar.close()
    for name in ("duplicate_ids", "skipped_no_user_turn", "skipped_prompt_too_long",
                 "skipped_empty_reply", "ended_early"):
        if getattr(stats, name):
            log.warning("regeneration: %s = %d", name, getattr(stats, name))
    stats.elapsed_s = time.perf_counter() - t0
    log.info("regenerate: %d conversations written, %d tokens in %.1f s = %.1f tok/s (%s engine, "
             "batch %d)", stats.written, stats.generated_tokens, stats.elapsed_s,
             stats.tokens_per_s, engine, batch_size)
    if stats.decode_steps:
        log.info("regenerate: prefill %.1f s, decode %.1f s (%d steps × %.0f ms)", stats.refill_s,
                 stats.decode_s, stats.decode_steps, stats.ms_per_decode_step)
    return stats


def _run_refill(target: Any, todo: list[_Conv], replay: _Replay, finish: Callable[[_Conv], None],
                flush: Callable[[], None], *, max_new_tokens: int, batch_size: int,
                temperature: float, top_k: int, top_p: float, stops: list[int],
                limit: int) -> None:
    """Continuous batching on the serving engine's plain decoding (`Engine.serve`,
    scheduler "none"): a conversation's next turn is queued as soon as its reply ends."""
    engine = Engine(target, None, settings=EngineSettings(
        scheduler="none", max_requests=batch_size, max_len=limit + max_new_tokens + 1,
        stop_token_ids=stops, plain_steps_per_call=_STEPS_PER_CALL))

    def request(i: int, k: int) -> list[Request]:
        c = todo[i]
        ids = replay.prompt(c, k)
        if ids is None:
            finish(c)
            return []
        return [Request(ids, replay.key(c, k), temperature, top_k, top_p, handle=(i, k))]

    def on_reply(req: Request, reply: list[int]) -> list[Request]:
        i, k = req.handle
        if replay.reply(todo[i], k, reply):
            return request(i, k + 1)
        finish(todo[i])
        return []

    for c in todo:
        c.history, c.alive, c.skipped = [], True, False
    first = [r for i in range(len(todo)) for r in request(i, 0)]
    if not first:
        return
    res = engine.serve(first, on_reply, max_new_tokens=max_new_tokens, after_replies=flush)
    stats = replay.stats
    decode_s = sum(r["seconds"] for r in res.rounds)
    stats.decode_s += decode_s
    stats.refill_s += max(res.wall_s - decode_s, 0.0)
    stats.decode_steps += sum(r["steps"] for r in res.rounds)


def _run_static(target: Any, convs: list[_Conv], done: set[str], replay: _Replay,
                finish: Callable[[_Conv], None], flush: Callable[[], None], *,
                max_new_tokens: int, batch_size: int, temperature: float, top_k: int,
                top_p: float, stops: list[int]) -> None:
    """Fixed groups of `batch_size` conversations, planned from the whole input (so a resumed
    run batches exactly as an uninterrupted one); turn k of a group is one static batch."""
    for start in range(0, len(convs), batch_size):
        group = convs[start:start + batch_size]
        if all(c.id in done for c in group):
            continue
        for c in group:
            c.history, c.alive, c.skipped = [], True, False
        for k in range(max(len(c.groups) for c in group)):
            rows, prompts = [], []
            for c in group:
                if not c.alive or k >= len(c.groups):
                    continue
                ids = replay.prompt(c, k)
                if ids is not None:
                    rows.append(c)
                    prompts.append(ids)
            if not rows:
                break
            keys = np.stack([replay.key(c, k) for c in rows])
            replies = generate_rows(target, prompts, keys, max_new_tokens=max_new_tokens,
                                    batch_size=batch_size, temperature=temperature, top_k=top_k,
                                    top_p=top_p, stop_token_ids=stops)
            for c, reply in zip(rows, replies):
                if not replay.reply(c, k, reply):
                    c.alive = False
        for c in group:
            finish(c)
        flush()


def _end(c: _Conv, k: int, stats: RegenStats, reason: str) -> None:
    """Turn k cannot be generated: skip the conversation (k = 0) or end it before turn k."""
    c.alive = False
    if k == 0:
        c.skipped = True
        setattr(stats, reason, getattr(stats, reason) + 1)
    else:
        stats.ended_early += 1


# ---------------------------------------------------------------- CLI


def load_prompt_files(paths: Sequence[str | os.PathLike[str]], *,
                      decontaminate: str | os.PathLike[str] | None = None) -> list[Conversation]:
    """Training conversation JSONL files, DeepSpec `{"turns": [...]}` prompt files (all turns),
    or named sources (`prompt_sources.PROMPT_SOURCES`, e.g. "offline-mix"), in order. `decontaminate`:
    drop prompts overlapping the evaluation files of that directory (the count is logged)."""
    out: list[Conversation] = []
    for path in paths:
        if not os.path.exists(path) and str(path) in PROMPT_SOURCES:
            out.extend(load_named_prompts(str(path)))
            continue
        first = None
        with open(path, "rb") as fh:
            for raw in fh:
                if raw.strip():
                    try:
                        first = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        first = None
                    break
        if isinstance(first, dict) and "turns" in first:
            out.extend(read_eval_file(path, first_turn_only=False))
        else:
            out.extend(load_conversations(path))
    if decontaminate is not None:
        from dspark_jax.data.contamination import filter_contaminated

        out, report = filter_contaminated(out, decontaminate)
        log.warning("%s", report.summary())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.data.regeneration",
                                description="Regenerate assistant turns with the target (resumable).")
    p.add_argument("--target", required=True, help="embedded target name or Hugging Face directory")
    p.add_argument("--prompts", required=True, nargs="+",
                   help=f"conversation / prompt JSONL files, or named sources {list(PROMPT_SOURCES)}")
    p.add_argument("--decontaminate", default=None, metavar="EVAL_DIR",
                   help="drop prompts sharing a 13-gram with any {\"turns\"} file of EVAL_DIR")
    p.add_argument("--out", required=True, help="output JSONL (appended to; resumed if present)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE)
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="use only the first N conversations")
    p.add_argument("--system-prompt", default=None,
                   help="system prompt for conversations without one ('auto': DeepSpec's choice "
                        "for the template, see chat.default_system_prompt_for)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip (first turn) or end (later turns) conversations with longer prompts "
                        "(default: context length - max new tokens)")
    p.add_argument("--dtype", default="float32", help="compute dtype (float32 / bfloat16)")
    p.add_argument("--engine", choices=ENGINES, default="refill",
                   help="refill: continuous batching (default); static: fixed batches (reference)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        conversations = load_prompt_files(args.prompts, decontaminate=args.decontaminate)
        if args.limit is not None:
            conversations = conversations[: args.limit]
        if not conversations:
            raise ValueError(f"no conversations in {args.prompts}")
        from dspark_jax.models.target import load_target

        target = load_target(args.target, dtype=args.dtype)
        system_prompt = args.system_prompt
        if system_prompt == "auto":
            from dspark_jax.data.chat import default_system_prompt_for

            system_prompt = default_system_prompt_for(target.tokenizer)
        stats = regenerate(target, conversations, args.out, max_new_tokens=args.max_new_tokens,
                           batch_size=args.batch_size, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                           progress=not args.no_progress, system_prompt=system_prompt,
                           max_prompt_tokens=args.max_prompt_tokens, engine=args.engine)
    except (ValueError, OSError, RegenerationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"regenerated {stats.written} conversations ({stats.already_done} already done): "
          f"{stats.generated_tokens} tokens in {stats.elapsed_s:.1f} s = "
          f"{stats.tokens_per_s:.1f} tok/s", file=sys.stderr)
    print(json.dumps(dataclasses.asdict(stats) | {"tokens_per_s": round(stats.tokens_per_s, 2),
                                                  "ms_per_decode_step":
                                                      round(stats.ms_per_decode_step, 1)}))
    return 0


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main)
