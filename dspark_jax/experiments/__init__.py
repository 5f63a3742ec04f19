"""Experiments: runs that train and evaluate several drafters and write a report.

  table1.py          the small-scale Table 1 (DSpark vs DFlash vs Eagle3 on the same data and
                     steps; `python -m dspark_jax.experiments.table1`)
  table1_report.py   its report: tables, learning curves, conditional acceptance
"""
