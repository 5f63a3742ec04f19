"""Another import path of `dspark_jax.serving.generation` (the same module object)."""

import sys

from dspark_jax.serving import generation as _module

sys.modules[__name__] = _module
