"""Offline evaluation of speculative decoding: the evaluation driver, acceptance statistics,
confidence calibration, results files, plots.

Modules: :mod:`dspark_jax.eval.runner` (the one driver of DeepSpec's offline protocol, SPEC §6,
that `evaluate` and `calibrate` decode through), :mod:`dspark_jax.eval.acceptance` (SPEC §6),
:mod:`dspark_jax.eval.calibration` (SPEC §7), :mod:`dspark_jax.eval.results` (an evaluation's
files, written by `evaluate` and read back by the analysis notebook),
:mod:`dspark_jax.eval.report_numbers` (ratios, means and JSON floats under one rule for NaN,
±inf and None), :mod:`dspark_jax.eval.plots`. DeepSpec's own loop on an export, the consumer check,
is :mod:`dspark_jax.interop.deepspec_loop`.
"""
