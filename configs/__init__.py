"""Experiment configs (ml_collections). Each file defines `get_config()` over the package's
config base, `dspark_jax/train/config_base.py`."""
