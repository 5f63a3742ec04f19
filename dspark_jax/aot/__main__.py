"""`python -m dspark_jax.aot [--decode] --config configs/NAME.py --topology v5p:2x4x4 ...`:
the training step (SPEC §4) or a serving round (paper §5.2–5.3) compiled for a TPU slice on
this machine (see dspark_jax/aot/command.py)."""

import os

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # compile-only: never open an accelerator
    from dspark_jax.aot.command import main
    from dspark_jax.cli_support import run_main

    # no persistent compilation cache: the programs are compiled for chips this machine lacks
    run_main(main, compilation_cache=False)
