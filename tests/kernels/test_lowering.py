"""The kernels lower for real accelerators without one: TPU (Mosaic, compiled ahead of time on
CPU with libtpu for a v5e topology) and GPU (Triton, exported for CUDA), at Qwen3-4B's shape
(V = 151,936, r = 256, γ = 7) and 16 requests."""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.markov_sample.kernel import markov_sample
from pallas_kernels.verify.kernel import verify

B, G, V, R = 16, 7, 151_936, 256


def _markov_specs(sharding=None):
    S = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    return (S((B, G), jnp.float32), S((B, G, V), jnp.bfloat16), S((V, R), jnp.bfloat16),
            S((V, R), jnp.bfloat16), S((B,), jnp.int32), S((B,), jnp.float32))


def _verify_specs(sharding=None):
    S = functools.partial(jax.ShapeDtypeStruct, sharding=sharding)
    return (S((B, G), jnp.float32), S((B,), jnp.float32), S((B, G + 1, V), jnp.float32),
            S((B, G, V), jnp.float32), S((B, G), jnp.int32), S((B,), jnp.int32))


@pytest.fixture(scope="module")
def tpu_device():
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: no ahead-of-time TPU compilation here")
    # other processes may hold libtpu's lock file; compiling needs no chip
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    from dspark_jax.aot.topology import topology_devices   # hides CPU-only XLA_FLAGS from libtpu

    return topology_devices("v5e:2x2")[0]


@pytest.mark.tpu
@pytest.mark.parametrize("name", ["markov_sample", "verify"])
def test_compiles_for_tpu_with_mosaic(tpu_device, name):
    sh = jax.sharding.SingleDeviceSharding(tpu_device)
    fn, specs = ((markov_sample, _markov_specs(sh)) if name == "markov_sample"
                 else (verify, _verify_specs(sh)))
    compiled = jax.jit(functools.partial(fn, backend="mosaic")).lower(*specs).compile()
    assert "tpu_custom_call" in compiled.as_text()
    assert compiled.memory_analysis().argument_size_in_bytes > 0


@pytest.mark.parametrize("name", ["markov_sample", "verify"])
def test_lowers_for_gpu_with_triton(name):
    from jax import export

    fn, specs = ((markov_sample, _markov_specs()) if name == "markov_sample"
                 else (verify, _verify_specs()))
    try:
        exported = export.export(
            jax.jit(functools.partial(fn, backend="triton")), platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        )(*specs)
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
        pytest.skip(f"Triton lowering unavailable: {e}")
    text = exported.mlir_module()
    assert "__gpu$xla.gpu.triton" in text
    # the Markov kernel serves all 16 requests from one program (one W2 stream per pass);
    # verification runs one program per request
    assert f"grid_x = {1 if name == 'markov_sample' else B} :" in text


def test_the_row_sampler_lowers_for_gpu_spread_over_the_vocabulary():
    """`row_sample` at one request and Qwen3's vocabulary: two Triton kernels, the first
    spread over the vocabulary's 149 tiles (not one program streaming the row), the second one
    program a row."""
    from jax import export

    from pallas_kernels.row_sample import row_sample

    try:
        exported = export.export(
            jax.jit(row_sample), platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        )(jax.ShapeDtypeStruct((1, V), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32))
    except (ImportError, ModuleNotFoundError) as e:  # jaxlib without the Triton dialect
        pytest.skip(f"Triton lowering unavailable: {e}")
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert "grid_x = 1 :" in text and "grid_y = 149 :" in text
