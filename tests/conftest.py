"""Shared test setup: CPU only, fp32 matmuls, 8 fake devices for sharding tests."""

import os
import shutil
import tempfile

from xla_flags import cpu_flags

# Must happen before JAX initialises its backend.
os.environ.setdefault("XLA_FLAGS", cpu_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One XLA compilation cache for the whole run, fresh each run: the pytest-xdist workers and the
# subprocesses tests start inherit this process's environment, so a program one of them
# compiled is loaded, not compiled again, by the others (same HLO and flags: same executable).
_OWN_CACHE = "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark_jax_xla_")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
