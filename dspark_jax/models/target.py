"""The public target-model handle: `load_target(name_or_path)` → `Target` (SPEC §2).

A `Target` bundles the config, tokenizer and the split NNX model (graphdef + state) with a few
jitted numpy-in/numpy-out conveniences for notebooks and external checks. Decoding and training
code uses `target.graphdef` / `target.state` directly inside their own jitted functions.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.models import layers as L
from dspark_jax.models.config import DecoderConfig
from dspark_jax.models.decoder import (KVCache, TargetDecoder, has_layer_buffers, init_cache,
                                      with_layer_buffers)
from dspark_jax.models.gemma4.decoder import Gemma4Stack
from dspark_jax.models.gemma4.layer_buffers import Gemma4Layers
from dspark_jax.models.io import hf as hf_io
from dspark_jax.models.io.gguf import locate_smollm2_gguf, read_gguf_checkpoint
from dspark_jax.models.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

EMBEDDED_TARGETS = ("smollm2-135m-instruct",)

_DTYPES = {"float32": jnp.float32, "fp32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16}


@functools.cache
def _warn_stacked(family: str) -> None:
    """Says once per family that its targets decode with the stacked layers on an
    accelerator."""
    import warnings

    warnings.warn(f"{family} targets decode with their stacked layers on this "
                  "accelerator (no per-layer layout): XLA copies each layer's weights out of the "
                  "stack every step (python -m dspark_jax.aot --chip h200 --decode shows the "
                  "bytes)", stacklevel=3)


def resolve_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


@dataclasses.dataclass
class Target:
    """A loaded target model. `state` may be replaced (e.g. resharded) by callers."""

    config: DecoderConfig
    graphdef: Any
    state: Any
    tokenizer: Any = None
    name: str = ""

    @classmethod
    def from_model(cls, model: TargetDecoder, tokenizer: Any = None, name: str = "") -> "Target":
        graphdef, state = nnx.split(model)
        return cls(config=model.cfg, graphdef=graphdef, state=state, tokenizer=tokenizer,
                   name=name)

    @property
    def model(self) -> TargetDecoder:
        return nnx.merge(self.graphdef, self.state)

    @property
    def dtype(self) -> Any:
        return self.model.dtype

    def on_accelerator(self) -> bool:
        """Whether the weights live on a GPU or TPU (else on the CPU; JAX's default backend
        where the state holds no placed array)."""
        leaf = jax.tree.leaves(self.state)[0]
        platforms = ({d.platform for d in leaf.devices()} if hasattr(leaf, "devices")
                     else {jax.default_backend()})
        return platforms != {"cpu"}

    @property
    def supports_layer_buffers(self) -> bool:
        """Whether this target's layers have the per-layer decoding layout
        (`models.decoder.with_layer_buffers`): Llama / Qwen3's `DecoderLayers` stack, Gemma4's
        segments, or either already unstacked."""
        layers = self.model.layers
        return isinstance(layers, (L.DecoderLayers, L.UnstackedLayers, Gemma4Stack, Gemma4Layers))

    def decoding_layout(self, layer_buffers: bool | None = None) -> "Target":
        """This target in the parameter layout every decoding path runs: prefill, one-token
        steps, verification and the engine alike.

        `layer_buffers` None (the default) chooses from the devices the weights live on: one
        buffer per decoder layer on a GPU or TPU (`models.decoder.with_layer_buffers`), where a
        scan over the stacked layers makes XLA copy each layer's weights out of the stack
        before its dots read them, so a one-token step streams them three times (`python -m
        dspark_jax.aot --chip h200 --decode` reports them); the stacked layers on a CPU, where
        steps and rounds run as fast on either layout and the stack compiles several times
        faster. True / False force one. Layers without the per-layer layout
        (`supports_layer_buffers`) are refused for True, and decode stacked for None with a
        warning naming the cost.

        The per-layer buffers are copies made once per `state` and kept with it; to hold the
        weights in device memory once, decode with the returned target and drop this one."""
        if layer_buffers is None:
            layer_buffers = self.on_accelerator()
            if layer_buffers and not self.supports_layer_buffers:
                _warn_stacked(self.config.family)
                return self
        if not layer_buffers:
            return self
        if not self.supports_layer_buffers:
            raise ValueError(f"{self.config.family} targets have no per-layer decoding "
                             "layout (layer_buffers=True): decode them with the stacked layers "
                             "(layer_buffers=False or None)")
        cached = self.__dict__.get("_layer_buffers")
        if cached is not None and cached[0] is self.state:
            return cached[1]
        gd, st = with_layer_buffers(self.graphdef, self.state)
        view = self if gd is self.graphdef else dataclasses.replace(self, graphdef=gd, state=st)
        self.__dict__["_layer_buffers"] = (self.state, view)
        return view

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty KV cache for this target's layers: one buffer per layer where the layers
        are (`decoding_layout`), so its steps read the cache where it lies too; stacked
        otherwise. `dtype` defaults to the compute dtype."""
        return init_cache(self.config, batch, max_len, dtype or self.dtype,
                          per_layer=has_layer_buffers(self.model))

    @functools.cached_property
    def _jit_forward(self):
        graphdef = self.graphdef

        @functools.partial(jax.jit, static_argnames=("tap_layer_ids", "want_logits"))
        def fwd(state, tokens, tap_layer_ids: tuple[int, ...], want_logits: bool):
            model = nnx.merge(graphdef, state)
            out = model(tokens, tap_layer_ids=tap_layer_ids)
            logits = model.logits(out.hidden) if want_logits else None
            return logits, out.taps

        return fwd

    def _check_ids(self, input_ids: np.ndarray) -> jax.Array:
        ids = np.asarray(input_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must be an int array [B, S], got {ids.dtype}{ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"input_ids outside the vocabulary [0, {self.config.vocab_size})")
        return jnp.asarray(ids, jnp.int32)

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        """float32 logits [B, S, V] of a causal forward over `input_ids` [B, S]."""
        logits, _ = self._jit_forward(self.state, self._check_ids(input_ids), (), True)
        return np.asarray(logits, np.float32)

    def hidden_states(self, input_ids: np.ndarray, layer_ids: Sequence[int]) -> np.ndarray:
        """Concatenated taps [B, S, len(layer_ids)·d]: output of layer i (−1 = embeddings)."""
        _, taps = self._jit_forward(self.state, self._check_ids(input_ids),
                                    tuple(int(i) for i in layer_ids), False)
        return np.asarray(taps, np.float32)


def load_target(name_or_path: str | os.PathLike, dtype: Any = "float32",
                param_dtype: Any | None = None, mesh: jax.sharding.Mesh | None = None,
                with_tokenizer: bool = True) -> Target:
    """Loads a target: the embedded "smollm2-135m-instruct" or a Hugging Face directory."""
    dtype = resolve_dtype(dtype)
    param_dtype = resolve_dtype(param_dtype) if param_dtype is not None else dtype
    name = str(name_or_path)
    if name in EMBEDDED_TARGETS:
        path = locate_smollm2_gguf()
        hf_cfg, tensors = read_gguf_checkpoint(path)
        cfg = DecoderConfig.from_hf_dict(hf_cfg, source=str(path))
        model = hf_io.target_from_tensors(cfg, tensors, str(path), dtype=dtype,
                                          param_dtype=param_dtype, mesh=mesh)
        tok = None
        if with_tokenizer:
            tok = tokenizer_from_gguf(path)
        return Target.from_model(model, tok, name)
    path = pathlib.Path(name)
    if not path.exists():
        raise ValueError(f"unknown target {name!r}: not a directory and not one of the embedded "
                         f"targets {list(EMBEDDED_TARGETS)}")
    cfg, model = hf_io.load_hf_target(path, dtype=dtype, param_dtype=param_dtype, mesh=mesh)
    tok = None
    if with_tokenizer and (path / "tokenizer.json").exists():
        tok = tokenizer_from_hf_dir(path)
    return Target.from_model(model, tok, str(path))
