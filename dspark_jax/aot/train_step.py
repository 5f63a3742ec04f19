"""Another import path of `dspark_jax.aot.training` (the same module object)."""

import sys

from dspark_jax.aot import training as _module

sys.modules[__name__] = _module
