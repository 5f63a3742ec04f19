"""Another import path of `dspark_jax.interop.deepspec_loop` (the same module object)."""

import sys

from dspark_jax.interop import deepspec_loop as _module

sys.modules[__name__] = _module
