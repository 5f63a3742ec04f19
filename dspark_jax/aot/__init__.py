"""Ahead-of-time compilation for TPU topologies on a CPU-only machine: do the paper's settings
fit a pod slice? Per chip: memory against HBM, FLOPs and the step-time lower bound.

  topology.py    compile-only TPU devices from libtpu; each chip's HBM, bandwidth, bf16 peak
  shapes.py      the target / drafter configs and the mesh, without weights (KNOWN_TARGETS)
  memory.py      a compiled program's per-chip bytes, compile-time OOMs, the fit verdict
  training.py    the training step (SPEC §4: batch 512 × 4096, 512 anchors, γ 7)
  decode.py      one serving round: draft step + ragged verification (paper §5.2–5.3)
  command.py     `python -m dspark_jax.aot [--decode] --config … --topology …` (`__main__.py`)

Modules import downward only (topology ← shapes, memory ← training, decode ← command); this
file imports nothing, so `import dspark_jax.aot.topology` loads no JAX.
"""
