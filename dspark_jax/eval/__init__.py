"""Offline evaluation of speculative decoding: acceptance statistics, confidence calibration, plots.

Modules: :mod:`dspark_jax.eval.acceptance` (SPEC §6), :mod:`dspark_jax.eval.calibration`
(SPEC §7), :mod:`dspark_jax.eval.plots`.
"""
