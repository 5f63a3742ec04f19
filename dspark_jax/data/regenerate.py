"""Another path of `dspark_jax.data.regeneration`: the same module; `python -m` runs it."""

import sys

if __name__ == "__main__":
    import runpy

    runpy.run_module("dspark_jax.data.regeneration", run_name="__main__", alter_sys=True)
else:
    from dspark_jax.data import regeneration as _module

    sys.modules[__name__] = _module
