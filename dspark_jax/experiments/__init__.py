"""Experiments: runs that train and evaluate several drafters and write a report.

  table1.py          the small-scale Table 1 (DSpark vs DFlash vs Eagle3 on the same data and
                     steps; `python -m dspark_jax.experiments.table1`)
  table1_report.py   its report: tables, learning curves, conditional acceptance
  tree_tau.py        τ against the draft-tree budget, the chain's beside it
                     (`python -m dspark_jax.experiments.tree_tau`)
"""
