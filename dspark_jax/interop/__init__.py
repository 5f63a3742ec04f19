"""Consumer checks: an export run by the software that consumes it, against our engine.

  deepspec_loop.py   DeepSpec's own evaluation loop (PyTorch) on a DeepSpec-format export;
                     the training job's eval stage reports its τ (`train/eval_stage.py`)
  llamacpp_loop.py   llama.cpp's own DSpark loop (`llama-speculative-simple --spec-type
                     draft-dspark`) on exports converted by its own converter, round by round
                     (`python -m dspark_jax.interop.llamacpp_loop`)

Both import the outside software only when run; neither is imported by the library below them.
"""
