"""Chat rendering and the assistant loss mask of DeepSpec training (SPEC §4 "Data").

`render_for_training` turns a conversation into the token ids the target sees and DeepSpec's
`loss_mask`: 1 on every assistant token from the first token after the assistant header through
the end-of-turn marker (ChatML: `<|im_end|>` and the following `\\n`), 0 elsewhere. Samples with
fewer than `MIN_LOSS_TOKENS` (14) loss tokens after truncation to `max_length` are dropped.
Qwen targets get the system prompt "You are a helpful assistant." when a sample has none.

How the mask is computed: the whole conversation is rendered ONCE with the tokenizer's chat
template (`add_generation_prompt=False`), so the ids are exactly
`apply_chat_template(messages, tokenize=True)`; the text is tokenized with character offsets and
each assistant turn's character span [end of its header, end of its end-of-turn marker) is found
by walking the rendered text in message order (each user/system content is skipped before
looking for the next assistant header, so header strings quoted inside a user message are never
taken for a turn). A token is a loss token iff its first character lies inside a span; a token
straddling the header/content boundary is not (it begins inside the header). Rendering prefixes
incrementally would be wrong for Qwen3, whose template renders a turn differently depending on
what follows it.

Thinking (Qwen3): DeepSpec trains on non-thinking data. Qwen3's template drops `<think>…</think>`
from assistant turns before the last user message and gives the final assistant turn a
`<think>\\n\\n</think>\\n\\n` block (empty unless the content carries reasoning). The rendered text
is what the target sees, so the loss covers it as rendered; like DeepSpec, the empty think block
of the final turn is inside the loss span by default (`loss_on_empty_think=False` leaves it out:
at inference with thinking disabled that block belongs to the prompt). `enable_thinking` only
changes Qwen3's generation prompt, which training renders do not use; `render_prompt` (eval and
regeneration prompts) passes `enable_thinking=False` as DeepSpec does.

Gemma4 (DeepSpec's "gemma4" template): turns open with `<|turn>model\n` and close with
`<turn|>\n` (the end-of-turn token is the stop token); like DeepSpec, every assistant content is
rendered behind the empty thought-channel prefix `<|channel>thought\n<channel|>` (unless it
already starts with it), which is outside the loss, and no default system prompt is added;
`render_prompt` ends a generation prompt with that prefix, so a prompt is exactly the training
render up to where the loss of the reply starts.

Tokenizers: a `dspark_jax.models.tokenizer.Tokenizer` (its `.hf` is used) or any transformers
fast tokenizer with a chat template.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark_jax.data.prompts import Conversation, Message

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
MIN_LOSS_TOKENS = 14
DEFAULT_MAX_LENGTH = 4096
EMPTY_THINK_BLOCK = "<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class TurnMarkers:
    """Literal strings that open an assistant turn and close any turn in a chat format."""

    name: str
    assistant_header: str
    end_of_turn: str
    # rendered in front of every assistant content and kept out of the loss (DeepSpec's
    # `assistant_loss_prefix`)
    assistant_prefix: str = ""
    # None: never add DeepSpec's default system prompt for this format
    adds_default_system_prompt: bool = True


CHATML = TurnMarkers("chatml", "<|im_start|>assistant\n", "<|im_end|>\n")  # Qwen, SmolLM2
GEMMA = TurnMarkers("gemma", "<start_of_turn>model\n", "<end_of_turn>\n")
LLAMA3 = TurnMarkers("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
GEMMA4 = TurnMarkers("gemma4", "<|turn>model\n", "<turn|>\n",
                     assistant_prefix="<|channel>thought\n<channel|>",
                     adds_default_system_prompt=False)
KNOWN_TURN_MARKERS: tuple[TurnMarkers, ...] = (CHATML, GEMMA4, GEMMA, LLAMA3)

_PROBE = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
_markers_cache: dict[str, TurnMarkers] = {}


class ChatTemplateError(ValueError):
    """The chat template's output does not match the expected turn structure."""


def hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind a project `Tokenizer` (its `.hf`), or the argument."""
    return getattr(tokenizer, "hf", tokenizer)


def _messages(conv: Conversation | Sequence[Mapping[str, str]]) -> list[Message]:
    raw = conv.messages if isinstance(conv, Conversation) else conv
    return [{"role": m["role"], "content": m["content"]} for m in raw]


def _render_text(hf: Any, messages: list[Message], add_generation_prompt: bool, enable_thinking: bool | None) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    text = hf.apply_chat_template(messages, **kwargs)
    if not isinstance(text, str):
        raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
    return text


def detect_turn_markers(tokenizer: Any) -> TurnMarkers:
    """Which `KNOWN_TURN_MARKERS` the tokenizer's chat template uses (probed by rendering)."""
    hf = hf_tokenizer(tokenizer)
    key = str(getattr(hf, "chat_template", None))
    if key not in _markers_cache:
        text = _render_text(hf, _PROBE, add_generation_prompt=False, enable_thinking=None)
        found = [m for m in KNOWN_TURN_MARKERS if m.assistant_header in text and m.end_of_turn in text]
        if not found:
            raise ChatTemplateError(
                f"unknown chat format (rendered probe {text!r}); pass markers=TurnMarkers(...) explicitly"
            )
        _markers_cache[key] = found[0]
    return _markers_cache[key]


def template_inserts_system_prompt(tokenizer: Any) -> bool:
    """True when the template adds its own system turn to a conversation without one (SmolLM2)."""
    hf = hf_tokenizer(tokenizer)
    with_sys = _render_text(hf, [{"role": "system", "content": "\x01"}, _PROBE[0]], False, None)
    without = _render_text(hf, _PROBE[:1], False, None)
    header = with_sys[: with_sys.index("\x01")]  # the text that opens a system turn
    # Gemma-style templates fold the system text into the user turn: same opening, then the user.
    return bool(header) and without.startswith(header) and not without[len(header) :].startswith("ping")


def default_system_prompt_for(tokenizer: Any) -> str | None:
    """DeepSpec's rule: Qwen-style templates get `DEFAULT_SYSTEM_PROMPT`; templates that insert
    their own default system prompt (SmolLM2) get None so theirs is kept; Gemma4 gets none."""
    try:
        if not detect_turn_markers(tokenizer).adds_default_system_prompt:
            return None
    except ChatTemplateError:
        pass
    return None if template_inserts_system_prompt(tokenizer) else DEFAULT_SYSTEM_PROMPT


def with_assistant_prefix(messages: Sequence[Mapping[str, str]], prefix: str) -> list[Message]:
    """Puts `prefix` in front of every assistant content that does not already start with it."""
    out = [{"role": m["role"], "content": m["content"]} for m in messages]
    for m in out:
        if prefix and m["role"] == "assistant" and not m["content"].startswith(prefix):
            m["content"] = prefix + m["content"]
    return out


def with_system_prompt(messages: Sequence[Mapping[str, str]], system_prompt: str | None) -> list[Message]:
    """Prepends `system_prompt` unless it is None or the conversation already has a system turn."""
    out = [{"role": m["role"], "content": m["content"]} for m in messages]
    if system_prompt is not None and not (out and out[0]["role"] == "system"):
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def assistant_char_spans(
    text: str, messages: Sequence[Mapping[str, str]], markers: TurnMarkers, *, loss_on_empty_think: bool = True
) -> list[tuple[int, int]]:
    """Character spans [content start, end-of-turn marker end) of each assistant turn in `text`.

    `text` must be the chat-template rendering of `messages`. Contents are searched for in
    message order; an assistant turn's end is the first end-of-turn marker after its visible
    content (the part after any `</think>`, which the template may have dropped or moved).
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        content = message["content"]
        if message["role"] != "assistant":
            found = text.find(content.strip(), cursor) if content.strip() else -1
            if found >= 0:
                cursor = found + len(content.strip())
            continue
        header = text.find(markers.assistant_header, cursor)
        if header < 0:
            raise ChatTemplateError(f"assistant turn {i}: header {markers.assistant_header!r} not found")
        start = header + len(markers.assistant_header)
        prefix = markers.assistant_prefix
        if prefix and text.startswith(prefix, start):
            start += len(prefix)
        if prefix and content.startswith(prefix):
            content = content[len(prefix):]
        if not loss_on_empty_think and text.startswith(EMPTY_THINK_BLOCK, start):
            start += len(EMPTY_THINK_BLOCK)
        visible = content.split("</think>")[-1].strip()
        after = start
        if visible:
            at = text.find(visible, start)
            if at < 0:
                raise ChatTemplateError(f"assistant turn {i}: content not found in the rendered text")
            after = at + len(visible)
        end = text.find(markers.end_of_turn, after)
        if end >= 0:
            end += len(markers.end_of_turn)
        else:  # e.g. a final turn rendered without the trailing newline of the marker
            bare = markers.end_of_turn.rstrip()
            end = text.find(bare, after) if bare else -1
            if end < 0:
                raise ChatTemplateError(f"assistant turn {i}: end-of-turn marker {markers.end_of_turn!r} not found")
            end += len(bare)
        spans.append((start, end))
        cursor = end
    return spans


def _tokenize_with_offsets(hf: Any, text: str) -> tuple[np.ndarray, np.ndarray]:
    if not getattr(hf, "is_fast", True):
        raise TypeError("a fast (Rust) tokenizer is required for character offsets")
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    starts = np.asarray([o[0] for o in enc["offset_mapping"]], dtype=np.int64)
    return ids, starts


def render_for_training(
    conv: Conversation | Sequence[Mapping[str, str]],
    tokenizer: Any,
    max_length: int = DEFAULT_MAX_LENGTH,
    *,
    default_system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    min_loss_tokens: int = MIN_LOSS_TOKENS,
    loss_on_empty_think: bool = True,
    enable_thinking: bool | None = None,
    markers: TurnMarkers | None = None,
    stats: collections.Counter[str] | None = None,
) -> dict[str, np.ndarray] | None:
    """Token ids and assistant loss mask of one training conversation (SPEC §4).

    Returns `{"input_ids": int32 [S], "loss_mask": int32 [S]}` with S ≤ `max_length` (right
    truncation), or None when fewer than `min_loss_tokens` loss tokens survive truncation.
    `default_system_prompt` is prepended when the conversation has no system turn (None: never;
    use `default_system_prompt_for(tokenizer)` to pick DeepSpec's choice per template).
    `stats`, if given, counts "seen", "kept", "truncated" and "dropped_min_loss_tokens".
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    hf = hf_tokenizer(tokenizer)
    markers = markers or detect_turn_markers(hf)
    if not markers.adds_default_system_prompt:
        default_system_prompt = None
    messages = with_system_prompt(_messages(conv), default_system_prompt)
    messages = with_assistant_prefix(messages, markers.assistant_prefix)
    text = _render_text(hf, messages, add_generation_prompt=False, enable_thinking=enable_thinking)
    ids, starts = _tokenize_with_offsets(hf, text)
    mask = np.zeros(ids.shape, dtype=np.int32)
    for lo, hi in assistant_char_spans(text, messages, markers, loss_on_empty_think=loss_on_empty_think):
        mask[(starts >= lo) & (starts < hi)] = 1
    if stats is not None:
        stats["seen"] += 1
    if ids.shape[0] > max_length:
        ids, mask = ids[:max_length], mask[:max_length]
        if stats is not None:
            stats["truncated"] += 1
    if int(mask.sum()) < min_loss_tokens:
        if stats is not None:
            stats["dropped_min_loss_tokens"] += 1
        return None
    if stats is not None:
        stats["kept"] += 1
    return {"input_ids": ids, "loss_mask": mask}


def render_dataset(
    conversations: Sequence[Conversation], tokenizer: Any, max_length: int = DEFAULT_MAX_LENGTH, **kwargs: Any
) -> tuple[list[dict[str, np.ndarray]], collections.Counter[str]]:
    """`render_for_training` over many conversations → (kept samples, counters)."""
    stats: collections.Counter[str] = collections.Counter()
    kept = []
    for conv in conversations:
        sample = render_for_training(conv, tokenizer, max_length, stats=stats, **kwargs)
        if sample is not None:
            kept.append(sample)
    return kept, stats


def _assistant_prefix(hf: Any) -> str:
    """The format's `assistant_prefix` (Gemma4's empty thought channel); "" for formats
    without one or templates `detect_turn_markers` does not recognise."""
    from jinja2 import TemplateError

    try:
        return detect_turn_markers(hf).assistant_prefix
    except (ChatTemplateError, TemplateError):  # e.g. a template that refuses the probe
        return ""


def render_prompt(
    messages: Conversation | Sequence[Mapping[str, str]],
    tokenizer: Any,
    *,
    system_prompt: str | None = None,
    enable_thinking: bool | None = False,
) -> np.ndarray:
    """Token ids (int32 [P]) of a generation prompt: the template with the generation prompt on
    and thinking disabled, as DeepSpec's evaluation and regeneration render prompts (no default
    system prompt unless `system_prompt` is given).

    Formats with an `assistant_prefix` (Gemma4) render the prompt exactly as the training
    render sees the context of a reply: earlier assistant turns carry the prefix, and unless
    thinking is enabled the prompt ends with it (`<|turn>model\n<|channel>thought\n<channel|>`).
    Templates that already pre-seed the empty thought channel after the generation prompt
    (Gemma4 31B/26B's) render the same text as DeepSpec's `encode_chat_messages`; for templates
    that do not (E2B/E4B's) it is appended, so the first generated token sits where the loss
    mask of `render_for_training` starts."""
    hf = hf_tokenizer(tokenizer)
    msgs = with_system_prompt(_messages(messages), system_prompt)
    prefix = _assistant_prefix(hf)
    if prefix:
        msgs = with_assistant_prefix(msgs, prefix)
    text = _render_text(hf, msgs, True, enable_thinking)
    if prefix and not enable_thinking and not text.endswith(prefix):
        text += prefix
    return np.asarray(hf(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
