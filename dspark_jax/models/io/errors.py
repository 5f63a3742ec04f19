"""The one checkpoint error type of dspark_jax (SPEC §3, §5: the checkpoints users load).

Every reader and writer of a checkpoint — Hugging Face targets, GGUF, DeepSpec and speculators
drafters, the confidence-calibration file next to a drafter, and the training checkpoints of
train/checkpoint.py (which subclass it) — raises `CheckpointError` or a subclass, with a message
that names the file and the tensor or field. It is a ValueError: a bad checkpoint is bad input.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A missing, inconsistent or mismatched checkpoint file (names the file and tensor)."""


class ExportError(CheckpointError):
    """A drafter that the requested export format cannot hold faithfully (names the field)."""


__all__ = ["CheckpointError", "ExportError"]
