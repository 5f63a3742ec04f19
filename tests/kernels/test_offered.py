"""The Pallas decoding kernels are offered only where they are no slower than the pure-JAX path:
on a GPU or TPU, asking for them is a clear error at construction, before anything compiles."""

import jax
import pytest

from dspark_jax.decoding import pallas_backend


def test_kernels_are_not_offered_on_gpu(monkeypatch):
    with pytest.raises(ValueError, match="sampler='pallas' is not offered on gpu"):
        pallas_backend.check_offered("sampler='pallas'", "gpu")
    with pytest.raises(ValueError, match="not offered on tpu: its Mosaic kernel reads more"):
        pallas_backend.check_offered("sampler='pallas'", "tpu")
    pallas_backend.check_offered("sampler='pallas'", "cpu")
    assert pallas_backend.kernel_mode() == dict(interpret=True, backend="triton")   # CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="not offered on gpu"):
        pallas_backend.kernel_mode()
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="not offered on tpu"):
        pallas_backend.kernel_mode()


@pytest.mark.parametrize("arg", ["sampler", "verifier"])
def test_engine_and_evaluate_refuse_them_on_gpu(monkeypatch, arg):
    from dspark_jax.evaluate import evaluate
    from dspark_jax.serving import Engine

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match=f"{arg}='pallas' is not offered on gpu"):
        Engine(None, None, **{arg: "pallas"})
    if arg == "verifier":
        with pytest.raises(ValueError, match="verifier='pallas' is not offered on gpu"):
            evaluate(None, None, "unused", verifier="pallas")
