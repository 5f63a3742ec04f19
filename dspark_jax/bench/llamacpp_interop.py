"""Another path of `dspark_jax.interop.llamacpp_loop`: the same module; `python -m` runs it."""

import sys

if __name__ == "__main__":
    import runpy

    runpy.run_module("dspark_jax.interop.llamacpp_loop", run_name="__main__", alter_sys=True)
else:
    from dspark_jax.interop import llamacpp_loop as _module

    sys.modules[__name__] = _module
