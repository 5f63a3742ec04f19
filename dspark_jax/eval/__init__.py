"""Offline evaluation of speculative decoding: the evaluation driver, acceptance statistics,
confidence calibration, results files, reports and plots.

Modules: :mod:`dspark_jax.eval.runner` (the one driver of DeepSpec's offline protocol, SPEC §6,
that `evaluate` and `calibrate` decode through), :mod:`dspark_jax.eval.eval_config` (`EvalConfig`,
every setting of an evaluation), :mod:`dspark_jax.eval.model_loading` (its target, drafter and
tokenizer), :mod:`dspark_jax.eval.dataset_runs` (the decoding and the numbers of each dataset),
:mod:`dspark_jax.eval.acceptance` (SPEC §6), :mod:`dspark_jax.eval.calibration` (SPEC §7),
:mod:`dspark_jax.eval.paper_table` (the paper's Table 1), :mod:`dspark_jax.eval.results_document`
(results.json and writing an evaluation's files), :mod:`dspark_jax.eval.results` (reading them
back, as the analysis notebook does), :mod:`dspark_jax.eval.results_markdown` (results.md),
:mod:`dspark_jax.eval.report_numbers` (ratios, means and JSON floats under one rule for NaN,
±inf and None), :mod:`dspark_jax.eval.plots`. DeepSpec's own loop on an export, the consumer check,
is :mod:`dspark_jax.interop.deepspec_loop`.
"""
