"""The public drafter handle: `init_draft(target, cfg, seed)` and `load_draft(path)` (SPEC §3, §5).

A `Draft` bundles a DraftConfig with the split NNX drafter (graphdef + state) and the per-slot
confidence temperatures of paper §3.2.1 (STS) when the drafter directory has them.
`block_logits` is the inference semantics of one DSpark/DFlash draft block, in numpy, for
notebooks and external checks. The drafter class comes from the draft layers' family
(models/families.py); loading and saving go through models/io/.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models.config import ConfigError
from dspark_jax.models.drafters.config import DraftConfig, validate_against_target
from dspark_jax.models.drafters.dspark import DSparkDraft
from dspark_jax.models.families import family
from dspark_jax.models.io.calibration_file import CalibrationFileError, load_temperatures
from dspark_jax.models.io.deepspec import (ExportError, faithful_format, read_deepspec_dir,
                                           write_deepspec_dir)
from dspark_jax.models.io.errors import CheckpointError
from dspark_jax.models.io.hf import build_from_pure, read_config_json
from dspark_jax.models.io.speculators import (is_speculators_config, read_speculators_dir,
                                              write_speculators_dir)
from dspark_jax.models.target import resolve_dtype


def draft_module_class(cfg: DraftConfig) -> type:
    """The NNX drafter class of `cfg`: its layer family's for its kind, else the kind's own."""
    return family(cfg.layer_family).drafter_classes.get(cfg.model_type, cfg.kind.module)


def create_draft_module(cfg: DraftConfig, seed: int = 0, dtype: Any = jnp.float32,
                        param_dtype: Any = jnp.float32) -> nnx.Module:
    return draft_module_class(cfg)(cfg, rngs=nnx.Rngs(seed), dtype=dtype,
                                   param_dtype=param_dtype)


@dataclasses.dataclass
class Draft:
    config: DraftConfig
    graphdef: Any
    state: Any
    # per-slot confidence temperatures fitted by `python -m dspark_jax.calibrate` (paper §3.2.1
    # STS), read from the drafter directory's confidence_calibration.json; None = uncalibrated
    confidence_temperatures: tuple[float, ...] | None = None

    @classmethod
    def from_model(cls, model: nnx.Module) -> "Draft":
        graphdef, state = nnx.split(model)
        return cls(config=model.cfg, graphdef=graphdef, state=state)

    @property
    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.state)

    @functools.cached_property
    def _jit_block(self):
        graphdef = self.graphdef

        @jax.jit
        def fn(state, feats, anchor, anchor_pos, prev):
            m = nnx.merge(graphdef, state)
            S = feats.shape[0]
            pos = jnp.arange(S, dtype=jnp.int32)[None]
            ck, cv = m.context_kv(feats[None], pos)
            visible = (jnp.arange(S) < anchor_pos)[None, None]
            h = m.draft_slots(m.backbone(anchor[None, None], anchor_pos[None, None], ck, cv,
                                         visible, jnp.ones((1, 1), bool))[0, 0])
            logits, conf = m.heads_teacher_forced(h, prev)
            return m.base_logits(h), logits, conf

        return fn

    def block_logits(self, context_features: np.ndarray, anchor_token: int,
                     anchor_position: int | None = None, prev_tokens: Any = None
                     ) -> dict[str, np.ndarray | None]:
        """One draft block. context_features [S, n·d] for positions 0..S−1; the anchor sits at
        `anchor_position` (default S; context at positions ≥ it is not visible); `prev_tokens`
        [γ] = x0..x_{γ−1} feed the sequential head (x0 = anchor; default: all anchor)."""
        cfg = self.config
        if not cfg.kind.parallel_block:
            raise ValueError(f"block_logits is the DSpark/DFlash block semantics; a "
                             f"{cfg.model_type} drafter drafts autoregressively")
        feats = np.asarray(context_features, np.float32)
        want = cfg.num_features * cfg.target.hidden_size
        if feats.ndim != 2 or feats.shape[1] != want:
            raise ValueError(f"context_features must be [S, {want}], got {feats.shape}")
        S = feats.shape[0]
        pos = S if anchor_position is None else int(anchor_position)
        g = cfg.num_drafts
        prev = np.full((g,), anchor_token) if prev_tokens is None else np.asarray(prev_tokens)
        if prev.shape != (g,):
            raise ValueError(f"prev_tokens must have length {g} (one per draft slot)")
        base, logits, conf = self._jit_block(self.state, jnp.asarray(feats),
                                             jnp.asarray(anchor_token, jnp.int32),
                                             jnp.asarray(pos, jnp.int32),
                                             jnp.asarray(prev, jnp.int32))
        return {"base_logits": np.asarray(base, np.float32),
                "logits": np.asarray(logits, np.float32),
                "confidence_logits": None if conf is None else np.asarray(conf, np.float32)}

    def sharing_tables_with(self, target: Any) -> "Draft":
        """This drafter with its frozen embedding and LM head replaced by the target's own
        arrays wherever they hold the same values on the same devices (a drafter's are frozen
        copies of its target's, SPEC §3), so the two models keep one buffer of each in device
        memory: 2·V·D weights, about 2.5 GB for Qwen3-8B in bf16. A table that differs
        (another dtype, a pruned draft vocabulary, other values or placement) stays the
        drafter's own."""
        model = nnx.merge(self.graphdef, self.state, copy=True)    # this drafter stays as is
        tm = target.model
        ours = {"embed": tm.embed.get_value(), "lm_head": tm.lm_head_weight()}
        shared = False
        for name, theirs in ours.items():
            var = getattr(model, name, None)
            if var is None or var.get_value() is theirs:
                continue
            if _same_table(var.get_value(), theirs):
                var.set_value(theirs)
                shared = True
        if not shared:
            return self
        graphdef, state = nnx.split(model)
        return dataclasses.replace(self, graphdef=graphdef, state=state)

    def save(self, path: str | os.PathLike, format: str = "auto") -> None:
        """Writes the drafter (plus our fields under `dspark_jax`) in "deepspec" format (for an
        Eagle3 drafter with a draft vocabulary: EAGLE-3's layout), or in "speculators" format
        (vLLM's, which carries a DSpark / DFlash draft vocabulary); "auto" picks the one that
        holds it exactly (`faithful_format`). `python -m dspark_jax.export` is the command-line
        form (atomic directory, every option)."""
        if format == "auto":
            format = "speculators" if faithful_format(self.config) == "speculators" \
                else "deepspec"
        if format == "deepspec":
            write_deepspec_dir(self.config, self.state, path)
        elif format == "speculators":
            write_speculators_dir(self.config, self.state, path)
        else:
            raise ExportError(f"format: {format!r} is not one of ('auto', 'deepspec', "
                              "'speculators')")


def _as_config(target_cfg: Any, draft_config: DraftConfig | Mapping[str, Any]) -> DraftConfig:
    if isinstance(draft_config, DraftConfig):
        return draft_config.replace(target=target_cfg)
    fields = dict(draft_config)
    fields.pop("target", None)
    return DraftConfig(target=target_cfg, **fields)


def init_draft(target: Any, draft_config: DraftConfig | Mapping[str, Any], seed: int = 0,
               dtype: Any = "float32", param_dtype: Any = "float32",
               from_target: bool = False) -> Draft:
    """A randomly initialised drafter for `target`, with embedding and LM head copied from it;
    `from_target` also starts its backbone from the target's own layers
    (`target_layers_init`)."""
    cfg = _as_config(target.config, draft_config)
    validate_against_target(cfg, target.config)
    model = create_draft_module(cfg, seed, resolve_dtype(dtype), resolve_dtype(param_dtype))
    tmodel = target.model
    emb = tmodel.embed.get_value()
    model.embed.set_value(emb.astype(model.embed.get_value().dtype))
    model.lm_head.set_value(tmodel.lm_head_weight().astype(model.lm_head.get_value().dtype))
    if from_target:
        target_layers_init(model, tmodel)
    return Draft.from_model(model)


def _same_table(a: Any, b: Any) -> bool:
    """a and b: arrays of one shape and dtype, placed alike, equal element for element; two
    abstract arrays (`jax.ShapeDtypeStruct`, an ahead-of-time compile's) alike in shape, dtype
    and sharding stand for a drafter exported from this target. Traced values are never
    equal (their values are unknown)."""
    kinds = (jax.Array, jax.ShapeDtypeStruct)
    if not (isinstance(a, kinds) and isinstance(b, kinds)) or a.shape != b.shape or \
            a.dtype != b.dtype:
        return False
    abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in (a, b)]
    try:
        sa, sb = a.sharding, b.sharding
        if (sa is None) != (sb is None) or (sa is not None and
                                            not sa.is_equivalent_to(sb, a.ndim)):
            return False
        return all(abstract) if any(abstract) else bool(_all_equal(a, b))
    except (AttributeError, jax.errors.ConcretizationTypeError):   # a traced array
        return False


@jax.jit
def _all_equal(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.all(a == b)


def copied_target_layers(cfg: DraftConfig) -> list[int]:
    """The target layers a `from_target` backbone starts from: the Ld layers that follow the last
    tapped layer (its output is exactly their input), or the target's last Ld layers when fewer
    follow it."""
    n, ld = cfg.target.num_hidden_layers, cfg.num_draft_layers
    first = min(max(cfg.target_layer_ids) + 1, n - ld)
    return list(range(first, first + ld))


def target_layers_init(model: nnx.Module, tmodel: nnx.Module) -> None:
    """Starts a DSpark/DFlash backbone (SPEC §3) from the target instead of noise, in place:

    - draft layer i ← target layer `copied_target_layers(cfg)[i]` (every weight and norm);
    - fc ← the identity on the last tap's slice (zeros elsewhere) and hidden_norm ← the first
      copied layer's input norm: the context hidden_norm(fc(features)) is then exactly that
      layer's normed input in the target, so the first draft layer's context K/V are the
      target's own K/V of the layer that follows the tap;
    - the final norm ← the target's final norm: the shared LM head then sees hidden states on
      the target's scale (a ones-norm gives logits far sharper than the target's and a first
      cross-entropy of ~60 nats on SmolLM2).

    The Markov and confidence heads stay random. Training still moves every copied weight; the
    start only spares the drafter from learning the target's representation from scratch, which
    a small budget cannot buy (the init A/B of
    docs/benchmark-log/main-job-tests-cpu-reference.md). Not for Eagle3 (its fused first layer
    reads 2·d) or Gemma4 drafters."""
    if not isinstance(model, DSparkDraft):
        raise ConfigError(f"train.init_from_target: only DSpark / DFlash drafters start from the "
                          f"target's layers, not {type(model).__name__}")
    cfg = model.cfg
    ids = np.asarray(copied_target_layers(cfg))
    src, dst = tmodel.layers, model.layers
    # a Llama target has no q/k norms: the Qwen3 draft layers keep DeepSpec's initialisation
    # (ones) for them, so the copied layers normalise q/k where the target did not
    for name in dst.NAMES:
        if hasattr(dst, name) and hasattr(src, name):
            var = getattr(dst, name)
            var.set_value(getattr(src, name).get_value()[ids].astype(var.get_value().dtype))
    D = cfg.target.hidden_size
    slot = cfg.target_layer_ids.index(max(cfg.target_layer_ids))
    fc = jnp.zeros(model.fc.get_value().shape, model.fc.get_value().dtype)
    model.fc.set_value(fc.at[slot * D:(slot + 1) * D].set(jnp.eye(D, dtype=fc.dtype)))
    model.hidden_norm.set_value(
        src.input_norm.get_value()[ids[0]].astype(model.hidden_norm.get_value().dtype))
    # a copy: the target's own array must survive the training step's buffer donation
    model.norm.set_value(jnp.array(tmodel.final_norm.get_value(),
                                   dtype=model.norm.get_value().dtype, copy=True))


def drafter_dir(path: str | os.PathLike) -> pathlib.Path:
    """The drafter directory `path` names: `path` itself where it holds a drafter (config.json
    + *.safetensors), else a training workdir's `export/` (a job exports there when its
    training finishes); a `CheckpointError` saying which it expected otherwise."""
    p = pathlib.Path(path)
    if (p / "config.json").exists() and any(p.glob("*.safetensors")):
        return p
    if (p / "export" / "config.json").exists():
        return p / "export"
    raise CheckpointError(f"{p}: neither a drafter directory (config.json + *.safetensors, "
                          "DeepSpec's or speculators' format) nor a training workdir with an "
                          "export/ directory (a job exports there when its training finishes)")


def load_draft(path: str | os.PathLike, target: Any = None, dtype: Any = None,
               param_dtype: Any = None, block_convention: str | None = None) -> Draft:
    """Loads a drafter directory: DeepSpec's format or speculators' (vLLM's), both as we
    export them, and DeepSpec's own checkpoints; a training workdir loads its `export/`
    (`drafter_dir`).

    With `target`, checks that the drafter was built for it (vocabulary, width, layer ids),
    and holds the target's own embedding and LM head where the drafter's equal them
    (`Draft.sharing_tables_with`: one copy of each in device memory). `dtype` / `param_dtype`
    (compute / stored) default to the target's, so the drafter runs as `aot --decode` compiles
    it; without a target, to float32.
    `block_convention` overrides the checkpoint's ("zlab" for z-lab DFlash checkpoints).
    A `confidence_calibration.json` in the directory sets `confidence_temperatures`.
    """
    tcfg = target.config if target is not None else None
    path = drafter_dir(path)
    read = (read_speculators_dir if pathlib.Path(path).is_dir()
            and is_speculators_config(read_config_json(path)) else read_deepspec_dir)
    cfg, pure = read(path, tcfg)
    if block_convention is not None:
        cfg = cfg.replace(block_convention=block_convention)
    if target is not None:
        validate_against_target(cfg, target.config, source=str(path))
    if dtype is None:
        dtype = "float32" if target is None else target.dtype
    if param_dtype is None:
        param_dtype = "float32" if target is None else target.model.embed.get_value().dtype
    dtype, param_dtype = resolve_dtype(dtype), resolve_dtype(param_dtype)
    abstract = nnx.eval_shape(lambda: create_draft_module(cfg, 0, dtype, param_dtype))
    model = build_from_pure(abstract, pure, lambda x: param_dtype)
    draft = Draft.from_model(model)
    if target is not None:
        draft = draft.sharing_tables_with(target)
    draft.confidence_temperatures = _load_confidence_temperatures(path, cfg)
    return draft


def _load_confidence_temperatures(path: str | os.PathLike, cfg: DraftConfig
                                  ) -> tuple[float, ...] | None:
    temps = load_temperatures(path, gamma=cfg.num_drafts)
    if temps is not None and not cfg.has_confidence:
        raise CalibrationFileError(f"{path}: has confidence temperatures but the drafter has no "
                                   "confidence head (enable_confidence_head is false)")
    return temps


__all__ = ["Draft", "init_draft", "load_draft", "drafter_dir", "create_draft_module",
           "ConfigError"]
