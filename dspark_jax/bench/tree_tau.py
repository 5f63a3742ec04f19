"""Another path of `dspark_jax.experiments.tree_tau`: the same module; `python -m` runs it."""

import sys

if __name__ == "__main__":
    import runpy

    runpy.run_module("dspark_jax.experiments.tree_tau", run_name="__main__", alter_sys=True)
else:
    from dspark_jax.experiments import tree_tau as _module

    sys.modules[__name__] = _module
