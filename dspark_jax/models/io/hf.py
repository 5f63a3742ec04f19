"""Hugging Face checkpoint interop for target decoders (SPEC §2: loading the target Mt).

Reads `config.json` + `model.safetensors` (or a sharded `model.safetensors.index.json`) for
Llama, Qwen3 and Gemma4 — each family maps its layers' tensor names and torch `Linear` layouts
([out, in]) into our einsum layouts (models/llama/hf_tensors.py, models/gemma4/hf_tensors.py);
the embeddings, final norm and LM head, which all name alike, are mapped here — and writes
params back as a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.
The safetensors and config.json readers here serve every checkpoint format of io/.
Never unpickles: only safetensors are read.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models.config import ConfigError, DecoderConfig
from dspark_jax.models.decoder import TargetDecoder, abstract_target
from dspark_jax.models.families import family_of
from dspark_jax.models.io.errors import CheckpointError, checked_tensor
from dspark_jax.sharding import state_shardings


# ----------------------------------------------------------------------------- safetensors
def read_safetensors_dir(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a directory's model.safetensors (single or sharded index) as numpy."""
    from safetensors import safe_open

    path = pathlib.Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in path.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"{path}: no model.safetensors or index found "
                                  f"(pickled .bin checkpoints are not loaded, by design)")
        files = found
    out: dict[str, np.ndarray] = {}
    for name in files:
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f}: listed in the index but missing")
        try:
            with safe_open(str(f), framework="flax") as st:
                for key in st.keys():
                    out[key] = np.asarray(st.get_tensor(key))
        except Exception as e:  # safetensors raises a variety of errors on corrupt files
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from e
    return out


_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                       "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int64": "I64",
                       "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
                       "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}

# the safetensors library's layout order: wider dtypes first (its `Dtype` enum, descending), so
# every tensor's data stays aligned to its element size; then by name
_SAFETENSORS_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
                      "I32", "U32", "F32", "F64", "I64", "U64")


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None,
                      progress: Callable[[str, int, int], None] | None = None) -> None:
    """Writes tensors in the safetensors format (an 8-byte little-endian header length, the
    JSON header padded to 8 bytes, then each tensor's little-endian bytes, laid out in the
    library's order, so the file is the one `safetensors.numpy.save_file` writes), one tensor
    after another into a temp file that is synced and renamed onto `path`.
    `progress(name, nbytes, total_bytes)` follows each tensor written."""
    import struct

    path = pathlib.Path(path)
    arrays = {}
    for k, v in tensors.items():
        a = np.require(np.asarray(v), requirements="C")     # keeps a 0-d tensor 0-d
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        arrays[k] = a
    for k, a in arrays.items():
        if a.dtype.name not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {k!r} has dtype {a.dtype}, which "
                                  "safetensors cannot hold")
    rank = lambda k: -_SAFETENSORS_ORDER.index(_SAFETENSORS_DTYPES[arrays[k].dtype.name])  # noqa: E731
    arrays = {k: arrays[k] for k in sorted(arrays, key=lambda k: (rank(k), k))}
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    total = 0
    for k, a in arrays.items():
        header[k] = {"dtype": _SAFETENSORS_DTYPES[a.dtype.name], "shape": list(a.shape),
                     "data_offsets": [total, total + a.nbytes]}
        total += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for k, a in arrays.items():
                f.write(a.reshape(-1).view(np.uint8).data)
                if progress is not None:
                    progress(k, a.nbytes, total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    f = pathlib.Path(path) / "config.json"
    if not f.exists():
        raise CheckpointError(f"{f}: missing (expected a Hugging Face model directory)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: invalid JSON at line {e.lineno}: {e.msg}") from e


# ----------------------------------------------------------------------------- target
def target_pure_dict(tensors: Mapping[str, np.ndarray], cfg: DecoderConfig,
                     source: str) -> dict[str, Any]:
    """HF Llama / Qwen3 / Gemma4 tensors → nested dict matching TargetDecoder: the embeddings,
    final norm and LM head (every family's `*ForCausalLM` names), the layers in the family's
    layout; a checkpoint with more layers than config.json is refused."""
    fam = family_of(cfg)
    pre = fam.target_prefix(tensors, source)
    V, D, n = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    pure: dict[str, Any] = {
        "embed": checked_tensor(tensors, f"{pre}embed_tokens.weight", (V, D), source,
                                "vocab_size"),
        "final_norm": checked_tensor(tensors, f"{pre}norm.weight", (D,), source, "hidden_size"),
        "layers": fam.target_from_hf(tensors, pre, cfg, source),
    }
    if not cfg.tie_word_embeddings:
        pure["lm_head"] = checked_tensor(tensors, "lm_head.weight", (V, D), source,
                                         "tie_word_embeddings")
    extra = [k for k in tensors if k.startswith(f"{pre}layers.{n}.")]
    if extra:
        raise CheckpointError(f"{source}: checkpoint has more layers than config.json field "
                              f"'num_hidden_layers' ({n}) says; e.g. {extra[0]!r}")
    return pure


def target_tensors(pure: Mapping[str, Any], cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """Inverse of `target_pure_dict` (numpy arrays in), in the `*ForCausalLM` layout."""
    tensors = {
        "model.embed_tokens.weight": pure["embed"],
        "model.norm.weight": pure["final_norm"],
        **family_of(cfg).target_to_hf(pure["layers"], cfg),
    }
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = pure["lm_head"]
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def build_from_pure(abstract: nnx.Module, pure: Mapping[str, Any], dtype_of: Callable[[Any], Any],
                    shardings: Any = None) -> nnx.Module:
    """Fills an abstract module with arrays from a nested pure dict (optionally sharded)."""
    graphdef, abs_state = nnx.split(abstract)
    flat_abs = dict(nnx.to_flat_state(abs_state))

    def convert(path: tuple, value: np.ndarray) -> jax.Array:
        var = flat_abs[path]
        want = var.get_value()
        arr = np.asarray(value)
        if tuple(arr.shape) != tuple(want.shape):
            raise CheckpointError(f"parameter {'/'.join(map(str, path))}: shape {arr.shape}, "
                                  f"model expects {want.shape}")
        return jnp.asarray(arr, dtype=want.dtype)

    flat_pure = _flatten(pure)
    missing = set(flat_abs) - set(flat_pure)
    if missing:
        raise CheckpointError(f"parameters not provided: {sorted('/'.join(map(str, m)) for m in missing)}")
    values = {p: convert(p, v) for p, v in flat_pure.items() if p in flat_abs}
    if shardings is not None:
        flat_sh = dict(nnx.to_flat_state(shardings))
        values = {p: jax.device_put(v, flat_sh[p]) for p, v in values.items()}
    nnx.replace_by_pure_dict(abs_state, _unflatten(values))
    return nnx.merge(graphdef, abs_state)


def _flatten(d: Mapping[str, Any], prefix: tuple = ()) -> dict[tuple, Any]:
    out: dict[tuple, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _unflatten(flat: Mapping[tuple, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, v in flat.items():
        cur = out
        for k in path[:-1]:
            cur = cur.setdefault(k, {})
        cur[path[-1]] = v
    return out


def target_from_tensors(cfg: DecoderConfig, tensors: Mapping[str, np.ndarray], source: str,
                        dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                        mesh: jax.sharding.Mesh | None = None) -> TargetDecoder:
    abstract = abstract_target(cfg, dtype=dtype, param_dtype=param_dtype)
    shardings = None
    if mesh is not None:
        shardings = state_shardings(nnx.state(abstract), mesh)
    pure = target_pure_dict(tensors, cfg, source)
    return build_from_pure(abstract, pure, lambda x: param_dtype, shardings)


def load_hf_target(path: str | os.PathLike, dtype: Any = jnp.float32,
                   param_dtype: Any | None = None, mesh: jax.sharding.Mesh | None = None
                   ) -> tuple[DecoderConfig, TargetDecoder]:
    """Loads a Hugging Face Llama/Qwen3 directory into a TargetDecoder."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a Hugging Face model dir)")
    raw = read_config_json(path)
    try:
        cfg = DecoderConfig.from_hf_dict(raw, source=str(path / "config.json"))
    except ConfigError:
        raise
    tensors = read_safetensors_dir(path)
    model = target_from_tensors(cfg, tensors, str(path), dtype=dtype,
                                param_dtype=param_dtype or dtype, mesh=mesh)
    return cfg, model


def export_hf_target(model: TargetDecoder, path: str | os.PathLike) -> pathlib.Path:
    """Writes config.json + model.safetensors that transformers loads (fp32 unless bf16 params)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    pure = nnx.to_pure_dict(nnx.state(model))
    to_np = lambda x: np.asarray(jax.device_get(x))
    tensors = target_tensors(jax.tree.map(to_np, pure), cfg)
    dtype_name = "bfloat16" if tensors["model.norm.weight"].dtype.name == "bfloat16" else "float32"
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = dtype_name
    write_safetensors(path / "model.safetensors", tensors)
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(hf, indent=2))
    os.replace(tmp, path / "config.json")
    return path
