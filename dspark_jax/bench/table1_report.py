"""Another import path of `dspark_jax.experiments.table1_report` (the same module object)."""

import sys

from dspark_jax.experiments import table1_report as _module

sys.modules[__name__] = _module
