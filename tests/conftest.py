"""Shared test setup: CPU only, fp32 matmuls, 8 fake devices for sharding tests, no persistent
compilation cache."""

import os

from xla_flags import cpu_flags

# Must happen before JAX initialises its backend.
os.environ.setdefault("XLA_FLAGS", cpu_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The command lines' persistent compilation cache (dspark_jax/cli_support.py) stays off: tests,
# and the commands they start, never write under the user's home.
os.environ["DSPARK_JAX_COMPILATION_CACHE"] = ""

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

