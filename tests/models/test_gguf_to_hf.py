"""The Hugging Face directory `models.io.gguf_to_hf.write_target_hf` writes for the embedded
SmolLM2 target: read back by `transformers.AutoTokenizer` (local files only, no remote code),
as DeepSpec, vLLM, SGLang and llama.cpp's converter read it, its tokenizer gives the same ids,
decoded text, special tokens, stop ids and chat-template prompts as our target's tokenizer
(`load_tokenizer("smollm2-135m-instruct")`, the one `load_target` builds from the GGUF)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from dspark_jax.data.chat import render_prompt
from dspark_jax.models.io.gguf_to_hf import write_target_hf
from dspark_jax.models.tokenizer import Tokenizer, load_tokenizer

# Digits (SmolLM2 isolates each one), newline and space runs before digits and letters, code,
# special-token strings and non-ASCII text: every place a GPT-2-only pre-tokenizer differs.
TEXTS = (
    "12345",
    "3.14159",
    "x=1000000",
    ":\n\n8",
    "a\n\n\nb",
    "a  1",
    "def f(x):\n    return x**2  # sq",
    "\t\tindented\n\n    \n  trailing   ",
    "   ",
    "naïve café – 日本語 🙂",
    "١٢٣ and ²³ and Ⅻ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "",
)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> pathlib.Path:
    return write_target_hf(tmp_path_factory.mktemp("target-hf") / "smollm2")


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def theirs(out_dir: pathlib.Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True, trust_remote_code=False)


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_and_decodes_as_our_target(theirs, ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    assert list(theirs.encode(text, add_special_tokens=False)) == ids, theirs.convert_ids_to_tokens(
        theirs.encode(text, add_special_tokens=False))
    # The default (add_special_tokens=True) adds nothing either: SmolLM2 adds no BOS/EOS.
    assert list(theirs.encode(text)) == ids
    assert theirs.decode(ids, clean_up_tokenization_spaces=False) == ours.decode(ids) == text


def test_newlines_before_a_digit_merge(theirs) -> None:
    ids = theirs.encode(":\n\n8", add_special_tokens=False)
    assert theirs.convert_ids_to_tokens(ids) == [":", "ĊĊ", "8"]


def test_special_tokens_and_stop_ids(theirs, ours: Tokenizer) -> None:
    assert theirs.special_tokens_map == ours.hf.special_tokens_map
    assert len(theirs) == ours.vocab_size
    assert theirs.model_max_length == ours.hf.model_max_length
    assert Tokenizer(theirs).stop_token_ids == ours.stop_token_ids
    assert _added(theirs) == _added(ours.hf)


def _added(hf) -> dict[str, bool]:
    """Added tokens: content -> special."""
    return {t.content: t.special for t in hf.added_tokens_decoder.values()}


def test_chat_template_renders_the_same_prompt(theirs, ours: Tokenizer) -> None:
    assert theirs.chat_template == ours.hf.chat_template
    for messages in ([{"role": "user", "content": "Write a function that adds 12 and 30.\n\n8"}],
                     [{"role": "user", "content": "naïve 日本語 🙂  x=100"}]):
        got, want = render_prompt(messages, theirs), render_prompt(messages, ours)
        np.testing.assert_array_equal(got, want)
        assert list(want) == ours.apply_chat_template(messages)


def test_loads_as_our_hf_dir_tokenizer(out_dir: pathlib.Path, ours: Tokenizer) -> None:
    """`load_tokenizer(dir)` (what `load_target(dir)` uses) tokenizes as the GGUF target too."""
    tok = load_tokenizer(out_dir)
    for text in TEXTS:
        assert tok.encode(text) == ours.encode(text)
    assert tok.stop_token_ids == ours.stop_token_ids


def test_directory_contents(out_dir: pathlib.Path) -> None:
    names = {p.name for p in out_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith(".tmp") or n.startswith(".")], names
    cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    # A class every transformers version loads straight from tokenizer.json.
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
