"""DeepSpec checkpoint interop for drafters (SPEC §3, §5): exports DeepSpec loads.

A DeepSpec drafter directory holds `config.json` — the target's Qwen3 config with
`num_hidden_layers` = draft layers, `tie_word_embeddings` false, `layer_types`, and the fields
DeepSpec's constructors and evaluators read (`DSPARK_FIELDS`, `EAGLE3_FIELDS`, from
deepspec/modeling/{dspark,eagle3}/qwen3/{config,modeling}.py and deepspec/eval/) — and
safetensors with exactly the names of DeepSpec's `Qwen3DSparkModel` / `Qwen3Eagle3Model` state
dicts (`deepspec_tensor_names`). We write exactly that; our own extra fields (training recipe,
conventions, and any value DeepSpec's field cannot express) ride along under a `dspark_jax` key
that DeepSpec ignores, so the round trip is exact.

Reading accepts what DeepSpec's evaluator (eval.py) maps: the architectures Qwen3DSparkModel /
Qwen3Eagle3Model / Eagle3DraftModel (and our Llama variants), tensors with or without a
`model.` prefix, and the Eagle3DraftModel (SpecForge) single-layer names `midlayer.*`. A missing
or unexpected tensor is an error naming the file.

A draft vocabulary (K of the target's V ids, `DraftConfig.draft_vocab`) travels as EAGLE-3 wrote
it, and this module owns that convention for every writer (here and models/io/speculators.py):
`lm_head.weight` (and a Markov `markov_w2`) with K rows, the ids in increasing target-id order;
`d2t` int64 [K], target_id = draft_id + d2t[draft_id]; `t2d` bool [V], True for the K ids.
Checked against SafeAILab/EAGLE `eagle/traineagle3/cnets.py` at 09fe6a05 (`Model.scandata`: the
top-K ids sorted, `d2t = [used_tokens[i] - i …]`, `t2d = [i in used_tokens …]`, registered as
buffers beside `lm_head = nn.Linear(hidden_size, draft_vocab_size)`; its config.json has
`draft_vocab_size`) and vLLM `vllm/model_executor/models/llama_eagle3.py` at 00bd1493
(`Eagle3LlamaForCausalLM`: `lm_head` of `config.draft_vocab_size` rows; `load_weights` loads
`d2t` as `draft_id_to_target_id` and skips `t2d`; `compute_logits` scatters the K logits to
`arange(K) + d2t`, -inf elsewhere). DeepSpec's
own format has no draft vocabulary (its `lm_head` has V rows), so a DSpark/DFlash drafter with one
exports as speculators (or DeepSpec's lossy full-vocabulary fallback), while an Eagle3 drafter
with one is written here in EAGLE-3's own checkpoint layout (`faithful_format`): DeepSpec's Eagle3
names plus the map above and `draft_vocab_size` in config.json — what the EAGLE-3 authors'
checkpoints and SpecForge hold and vLLM's / SGLang's Eagle3 loaders read. Reading maps any of
these back to a V-row `lm_head` (zero rows outside the K ids, which decoding masks to probability
0) and the K ids into the DraftConfig.

What depends on the draft layers' family (Gemma4's `Gemma4DSparkModel` keeps the target's
Gemma4 config and its own layer tensors) is that family's record in models/families.py; what
depends on the drafter kind (its architecture, config.json fields and tensors past the shared
ones) is that kind's `DrafterKind` record in models/drafter_kinds.py, whose layouts are
models/io/drafter_layouts.py.
"""

from __future__ import annotations

import json
import os
import warnings
import pathlib
import re
from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx

from dspark_jax.models.config import ConfigError, DecoderConfig
from dspark_jax.models.drafters.config import DraftConfig
from dspark_jax.models.drafters.kind import (DrafterKind, drafter_kinds,
                                             kind_by_deepspec_architecture)
from dspark_jax.models.families import FAMILIES, family, family_by_deepspec_prefix
from dspark_jax.models.io.drafter_layouts import (DSPARK_FIELDS, DSPARK_IF_CONFIDENCE,  # noqa: F401
                                                  DSPARK_IF_MARKOV, EAGLE3_FIELDS)
from dspark_jax.models.io.errors import CheckpointError, ExportError, checked_tensor
from dspark_jax.models.io.hf import read_config_json, read_safetensors_dir, write_safetensors

EAGLE3_DRAFT_MODEL = "Eagle3DraftModel"   # eval.py maps it to the Qwen3 Eagle3 evaluator


class LegacyDrafterWarning(UserWarning):
    """A drafter checkpoint in a legacy dspark_jax layout (Llama draft layers) that only we load."""

INITIALIZER_RANGE = 0.02    # DeepSpec's drafters inherit Qwen3's (post_init reads it)


def _architecture_pattern() -> re.Pattern[str]:
    """<family prefix><kind architecture>[Model|ForCausalLM], over the registered records."""
    archs = {a: None for k in drafter_kinds().values() for a in k.deepspec_architectures}
    return re.compile(r"^(" + "|".join(f.deepspec_prefix for f in FAMILIES.values())
                      + r")(" + "|".join(archs) + r")(Model|ForCausalLM)?$")


def _alias_kind(architecture: str) -> DrafterKind | None:
    """The kind a whole architecture name (`DrafterKind.deepspec_aliases`) stands for."""
    return next((k for k in drafter_kinds().values() if architecture in k.deepspec_aliases),
                None)


def _arch_info(raw: Mapping[str, Any], source: str) -> tuple[str, DrafterKind]:
    pattern = _architecture_pattern()
    for a in raw.get("architectures") or []:
        aliased = _alias_kind(a)
        if aliased is not None:
            return ("llama" if raw.get("model_type") == "llama" else "qwen3"), aliased
        m = pattern.match(a)
        if m:
            return (family_by_deepspec_prefix(m.group(1)).name,
                    kind_by_deepspec_architecture(m.group(2)))
    raise ConfigError(f"{source}: not a DeepSpec drafter (architectures "
                      f"{raw.get('architectures')!r}; expected e.g. Qwen3DSparkModel, "
                      f"Qwen3Eagle3Model, {EAGLE3_DRAFT_MODEL})")


def draft_config_from_deepspec(raw: Mapping[str, Any], source: str = "config.json",
                               target: DecoderConfig | None = None) -> DraftConfig:
    """DeepSpec config.json → DraftConfig (the target shape comes from `target` if given)."""
    family_name, kind = _arch_info(raw, source)
    layers = family(family_name)
    ours = dict(raw.get("dspark_jax") or {})
    ours.pop("export", None)     # how the directory was written (write_deepspec_dir)
    layer_shape = layers.deepspec_layer_config(raw, source)
    if target is not None:
        layers.check_draft_shapes(layer_shape, target, source)
    if layers.legacy_draft_layers and not any(_alias_kind(a)
                                              for a in raw.get("architectures") or []):
        # a legacy dspark_jax export with Llama draft layers (no q/k norm): only we load it
        warnings.warn(f"{source}: a Llama-layer drafter ({raw.get('architectures')}, no q/k "
                      "norms) from an older dspark_jax; it loads as the drafter it is, but no "
                      "other consumer (DeepSpec, vLLM, SGLang, llama.cpp) can load it. Re-export "
                      "a retrained drafter to get Qwen3DSparkModel / Qwen3Eagle3Model layers.",
                      LegacyDrafterWarning, stacklevel=3)
    n_draft = layer_shape.num_hidden_layers
    ids = tuple(int(i) for i in raw.get("target_layer_ids") or ours.get("target_layer_ids") or ())
    if not ids:
        raise ConfigError(f"{source}: missing required field 'target_layer_ids'")
    if target is not None:
        for field in ("vocab_size", "hidden_size"):
            if getattr(layer_shape, field) != getattr(target, field):
                raise ConfigError(
                    f"{source}: drafter was built for a target with {field}="
                    f"{getattr(layer_shape, field)}, but the target has {getattr(target, field)}")
    else:
        n_target = int(raw.get("num_target_layers") or max(ids) + 2)
        # the target's own layers are not in the file: its shape, full attention throughout
        target = layer_shape.replace(
            num_hidden_layers=n_target,
            layer_types=("full_attention",) * n_target if layer_shape.layer_types else ())
    fields: dict[str, Any] = dict(target_layer_ids=ids, layer_family=family_name)
    fields.update(kind.config_from_deepspec(raw, n_draft, target.vocab_size))
    # our own fields (written by dspark_jax) take precedence: they are exact
    known = {f for f in DraftConfig.__dataclass_fields__ if f != "target"}
    unknown = sorted(set(ours) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown fields {unknown} under 'dspark_jax'")
    for k, v in ours.items():
        fields[k] = tuple(v) if k in ("target_layer_ids", "draft_vocab") else v
    return DraftConfig(target=target, **fields)


def deepspec_config_dict(cfg: DraftConfig) -> dict[str, Any]:
    """config.json of a drafter: DeepSpec's fields top-level, ours under `dspark_jax`."""
    layer_cfg = cfg.layer_config()
    layers = family(cfg.layer_family)
    hf = layers.deepspec_base_config(cfg)
    prefix = layers.deepspec_prefix
    arch = cfg.kind.deepspec_architectures[0]
    n = layer_cfg.num_hidden_layers
    hf.setdefault("layer_types", ["full_attention"] * n)
    hf.update(architectures=[f"{prefix}{arch}Model"], tie_word_embeddings=False,
              attention_dropout=0.0,
              initializer_range=INITIALIZER_RANGE,
              num_target_layers=cfg.target.num_hidden_layers,
              target_layer_ids=list(cfg.target_layer_ids))
    hf.update(cfg.kind.deepspec_config(cfg))     # an Eagle3 draft vocabulary: EAGLE-3's layout
    hf["dspark_jax"] = {k: v for k, v in cfg.to_dict().items()
                        if k != "target" and (k not in hf or hf[k] != v)}
    return hf


# ----------------------------------------------------------------------------- tensors
def deepspec_tensor_names(cfg: DraftConfig) -> list[str]:
    """Every tensor of DeepSpec's state dict for this drafter (Qwen3DSparkModel: embed_tokens,
    layers, norm, fc, hidden_norm, lm_head, markov_head, confidence_head; Qwen3Eagle3Model:
    embed_tokens, fc, layers with their hidden_norm, norm, lm_head): those every drafter has,
    then its kind's (`DrafterKind.tensor_names`)."""
    lc = cfg.layer_config()
    names = ["embed_tokens.weight", "lm_head.weight", "norm.weight", "fc.weight"]
    # the layers' own names (Gemma4: sandwich norms, layer scalar, k=v variants)
    layer_names = family(cfg.layer_family).layer_tensor_names
    attn_in = cfg.kind.attn_in_dim(lc)
    for i in range(lc.num_hidden_layers):
        names += [f"layers.{i}.{n}" for n in layer_names(lc, i, attn_in)]
    return names + cfg.kind.tensor_names(cfg)


# the tensors with one row per proposable id: K rows with a draft vocabulary, V without
DRAFT_VOCAB_ROWS = ("lm_head.weight", "markov_head.markov_w2.weight")


def draft_vocab_tensors(cfg: DraftConfig, tensors: Mapping[str, np.ndarray]
                        ) -> dict[str, np.ndarray]:
    """V-row tensors → the draft vocabulary's layout (module docstring): the K rows of
    `DRAFT_VOCAB_ROWS`, in increasing target-id order, and `d2t` / `t2d`. Unchanged without one."""
    t = dict(tensors)
    if not cfg.pruned_vocab:
        return t
    ids = np.asarray(cfg.draft_vocab, np.int64)
    for name in DRAFT_VOCAB_ROWS:
        if name in t:
            t[name] = np.ascontiguousarray(np.asarray(t[name])[ids])
    t2d = np.zeros((cfg.target.vocab_size,), bool)
    t2d[ids] = True
    t["d2t"] = ids - np.arange(len(ids), dtype=np.int64)   # target_id = draft_id + d2t[draft_id]
    t["t2d"] = t2d
    return t


def _draft_vocab_ids(d2t: Any, t2d: Any, rows: int, V: int, source: str
                     ) -> tuple[int, ...] | None:
    """The target ids a d2t / t2d pair names (either may be absent), checked against each other
    and against the `rows` of `lm_head.weight`; None for the full vocabulary."""
    ids = None
    if d2t is not None:
        d2t = np.asarray(d2t)
        if d2t.ndim != 1 or not np.issubdtype(d2t.dtype, np.integer):
            raise CheckpointError(f"{source}: d2t must be integer offsets of shape [K], got "
                                  f"{d2t.dtype} {list(d2t.shape)}")
        if len(d2t) != rows:
            raise CheckpointError(f"{source}: d2t has {len(d2t)} entries but lm_head.weight has "
                                  f"{rows} rows (one per draft id)")
        ids = np.arange(len(d2t), dtype=np.int64) + d2t.astype(np.int64)
        if len(ids) and (ids[0] < 0 or ids[-1] >= V or (np.diff(ids) <= 0).any()):
            raise CheckpointError(f"{source}: d2t does not name increasing target ids in "
                                  f"[0, {V}) (target_id = draft_id + d2t[draft_id])")
    if t2d is not None:
        t2d = np.asarray(t2d)
        if t2d.shape != (V,):
            raise CheckpointError(f"{source}: t2d has shape {list(t2d.shape)}; the target's "
                                  f"vocabulary needs [{V}]")
        marked = np.flatnonzero(t2d.astype(bool))
        if len(marked) != rows:
            raise CheckpointError(f"{source}: t2d marks {len(marked)} ids but lm_head.weight has "
                                  f"{rows} rows (one per draft id)")
        if ids is not None and not np.array_equal(marked, ids):
            raise CheckpointError(f"{source}: d2t and t2d name different draft vocabularies")
        ids = marked
    if ids is not None and not len(ids):
        raise CheckpointError(f"{source}: d2t / t2d map an empty draft vocabulary")
    if ids is None or len(ids) == V:
        return None
    return tuple(int(i) for i in ids)


def canonical_tensors(cfg: DraftConfig, tensors: Mapping[str, np.ndarray], source: str
                      ) -> tuple[DraftConfig, dict[str, np.ndarray]]:
    """The checkpoint's tensors under DeepSpec's names, exactly `deepspec_tensor_names(cfg)`,
    and `cfg` with the draft vocabulary they carry: strips a `model.` prefix (Hugging Face's
    base-model prefix), maps Eagle3DraftModel's `midlayer.` to `layers.0.`, and turns a d2t / t2d
    map (module docstring; an identity map is the full vocabulary) into `cfg.draft_vocab` with
    V-row `DRAFT_VOCAB_ROWS` (zeros outside the K ids). Anything missing, unexpected or
    inconsistent is a CheckpointError naming `source`."""
    t = dict(tensors)
    d2t, t2d = t.pop("d2t", None), t.pop("t2d", None)
    if t and all(k.startswith("model.") for k in t if k != "lm_head.weight"):
        t = {k[len("model."):] if k.startswith("model.") else k: v for k, v in t.items()}
    for alias, name in cfg.kind.tensor_aliases:     # Eagle3DraftModel's `midlayer.`
        t = {(name + k[len(alias):]) if k.startswith(alias) else k: v for k, v in t.items()}
    V = cfg.target.vocab_size
    head = t.get("lm_head.weight")
    rows = V if head is None else int(np.shape(head)[0])
    ids = _draft_vocab_ids(d2t, t2d, rows, V, source)
    if ids is None and cfg.pruned_vocab:
        raise CheckpointError(f"{source}: the config gives a {cfg.draft_vocab_size}-id draft "
                              "vocabulary but the tensors map none (no d2t / t2d)")
    if ids is not None:
        if cfg.draft_vocab and ids != cfg.draft_vocab:
            raise CheckpointError(f"{source}: d2t / t2d disagree with the config's draft_vocab")
        if cfg.draft_vocab_size and len(ids) != cfg.draft_vocab_size:
            raise CheckpointError(f"{source}: d2t / t2d map {len(ids)} ids but the config's "
                                  f"draft_vocab_size is {cfg.draft_vocab_size}")
        cfg = cfg.replace(draft_vocab_size=len(ids), draft_vocab=ids)
        for name in DRAFT_VOCAB_ROWS:
            if name in t:
                k_rows = np.asarray(t[name])
                if k_rows.shape[0] != len(ids):
                    raise CheckpointError(f"{source}: tensor {name!r} has {k_rows.shape[0]} "
                                          f"rows, the draft vocabulary {len(ids)}")
                full = np.zeros((V,) + k_rows.shape[1:], k_rows.dtype)
                full[np.asarray(ids)] = k_rows
                t[name] = full
    want = deepspec_tensor_names(cfg)
    missing = [k for k in want if k not in t]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more: {missing[1:6]})"
                                 if len(missing) > 1 else ""))
    unexpected = sorted(set(t) - set(want))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensors {unexpected[:8]}"
                              + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
                              + f" for a {cfg.model_type} drafter with this config")
    return cfg, t


def draft_pure_from_deepspec(cfg: DraftConfig, tensors: Mapping[str, np.ndarray], source: str
                             ) -> dict[str, Any]:
    """DeepSpec tensor names → nested dict matching the drafter's NNX module: the parts every
    drafter has, then its kind's (`DrafterKind.pure_from_tensors`)."""
    t = cfg.target
    V, D, n = t.vocab_size, t.hidden_size, cfg.num_features
    lc = cfg.layer_config()
    g = lambda k, s: checked_tensor(tensors, k, s, source)
    pure: dict[str, Any] = {
        "embed": g("embed_tokens.weight", (V, D)),
        "lm_head": g("lm_head.weight", (V, D)),
        "norm": g("norm.weight", (D,)),
        "fc": g("fc.weight", (D, n * D)).T,
    }
    pure["layers"] = family(cfg.layer_family).import_layers(
        tensors, "layers.", lc, source, attn_in_dim=cfg.kind.attn_in_dim(lc))
    pure.update(cfg.kind.pure_from_tensors(cfg, tensors, source))
    return pure


def deepspec_tensors_from_pure(cfg: DraftConfig, pure: Mapping[str, Any]) -> dict[str, np.ndarray]:
    to_np = lambda x: np.asarray(jax.device_get(x))
    layers = {k: to_np(v) for k, v in pure["layers"].items()}
    layer_tensors = family(cfg.layer_family).export_layers(layers, "layers.", cfg.layer_config())
    out = {
        "embed_tokens.weight": to_np(pure["embed"]),
        "lm_head.weight": to_np(pure["lm_head"]),
        "norm.weight": to_np(pure["norm"]),
        "fc.weight": to_np(pure["fc"]).T,
        **layer_tensors,
        **cfg.kind.tensors_from_pure(cfg, pure),
    }
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def read_deepspec_dir(path: str | os.PathLike, target: DecoderConfig | None = None
                      ) -> tuple[DraftConfig, dict[str, Any]]:
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected a DeepSpec drafter directory)")
    raw = read_config_json(path)
    cfg = draft_config_from_deepspec(raw, str(path / "config.json"), target)
    single = path / "model.safetensors"
    source = str(single if single.exists() else path)
    cfg, tensors = canonical_tensors(cfg, read_safetensors_dir(path), source)
    return cfg, draft_pure_from_deepspec(cfg, tensors, source)


FULL_VOCAB_FALLBACK_NOTE = (
    "full-vocabulary fallback of a drafter trained with a {k}-id draft vocabulary: DeepSpec's "
    "format has no draft vocabulary, so every consumer of this directory proposes from all {v} "
    "ids, including ids the drafter was never trained to rank; DeepSpec's loop measures a "
    "different tau than dspark_jax with the draft vocabulary (export --format speculators "
    "carries it)")


def faithful_format(cfg: DraftConfig) -> str:
    """The export format that holds `cfg` exactly: "deepspec" for a full-vocabulary drafter,
    else its kind's `pruned_vocab_format`: "eagle3" for an Eagle3 drafter (EAGLE-3's layout,
    which `write_deepspec_dir` writes for it), "speculators" for a DSpark / DFlash drafter
    (DeepSpec's format has only the lossy full-vocabulary fallback for it)."""
    if not cfg.pruned_vocab:
        return "deepspec"
    return cfg.kind.pruned_vocab_format


def full_vocab_fallback(cfg: DraftConfig) -> DraftConfig:
    """The drafter a DeepSpec-format export of `cfg` really is: the same weights proposing from
    the whole vocabulary (the draft vocabulary dropped)."""
    return cfg.replace(draft_vocab_size=0, draft_vocab=())


def write_deepspec_dir(cfg: DraftConfig, state: Any, path: str | os.PathLike,
                       full_vocab_fallback_ok: bool = False,
                       progress: Callable[[str, int, int], None] | None = None
                       ) -> pathlib.Path:
    """Exports a drafter (nnx.State or pure dict) in DeepSpec's format, each file atomically.

    An Eagle3 drafter with a draft vocabulary is written in EAGLE-3's layout (module docstring:
    a K-row `lm_head`, `d2t` / `t2d`, `draft_vocab_size`). A DSpark / DFlash one cannot be a
    faithful DeepSpec checkpoint (its `lm_head` has V rows and no bias, there is no `d2t`): that
    is an `ExportError`, unless `full_vocab_fallback_ok`, which writes the full-vocabulary
    drafter, warns, and records the fact in config.json (`dspark_jax.export`).
    `progress(name, nbytes, total_bytes)` follows each tensor written (`write_safetensors`)."""
    path = pathlib.Path(path)
    export_note = None
    if faithful_format(cfg) == "speculators":
        if not full_vocab_fallback_ok:
            raise ExportError(
                f"draft_vocab_size: the drafter proposes from a {cfg.draft_vocab_size}-id draft "
                "vocabulary, which DeepSpec's DSpark format cannot hold (a "
                f"{cfg.target.vocab_size}-row lm_head, no d2t); export it with --format "
                "speculators, or pass --full-vocab-fallback to write the full-vocabulary "
                "drafter (DeepSpec's loop then measures a different tau)")
        export_note = FULL_VOCAB_FALLBACK_NOTE.format(k=cfg.draft_vocab_size,
                                                      v=cfg.target.vocab_size)
        warnings.warn(f"{path}: {export_note}", stacklevel=2)
        trained_k = cfg.draft_vocab_size
        cfg = full_vocab_fallback(cfg)
    path.mkdir(parents=True, exist_ok=True)
    pure = state if isinstance(state, Mapping) and not isinstance(state, nnx.State) \
        else nnx.to_pure_dict(state)
    tensors = deepspec_tensors_from_pure(cfg, pure)
    assert sorted(tensors) == sorted(deepspec_tensor_names(cfg)), "export names drifted"
    tensors = draft_vocab_tensors(cfg, tensors)     # an Eagle3 draft vocabulary: EAGLE-3's layout
    write_safetensors(path / "model.safetensors", tensors, progress=progress)
    config = deepspec_config_dict(cfg)
    if export_note is not None:
        config["dspark_jax"]["export"] = {"full_vocab_fallback": True,
                                          "trained_draft_vocab_size": trained_k,
                                          "note": export_note}
    write_json_atomic(path / "config.json", config)
    return path


def write_json_atomic(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
