"""Experiment configs (ml_collections). Each file defines `get_config()`; see configs/common.py."""
