"""The one checkpoint error type of dspark_jax (SPEC §3, §5: the checkpoints users load).

Every reader and writer of a checkpoint — Hugging Face targets, GGUF, DeepSpec and speculators
drafters, the confidence-calibration file next to a drafter, and the training checkpoints of
train/checkpoint.py (which subclass it) — raises `CheckpointError` or a subclass, with a message
that names the file and the tensor or field. It is a ValueError: a bad checkpoint is bad input.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


class CheckpointError(ValueError):
    """A missing, inconsistent or mismatched checkpoint file (names the file and tensor)."""


class ExportError(CheckpointError):
    """A drafter that the requested export format cannot hold faithfully (names the field)."""


def checked_tensor(tensors: Mapping[str, Any], key: str, shape: tuple[int, ...], source: str,
                   field: str | None = None) -> np.ndarray:
    """tensors[key] as an array of `shape`; else a CheckpointError naming `source` and the
    tensor (and, where given, the config.json `field` that sets the expected shape)."""
    if key not in tensors:
        raise CheckpointError(f"{source}: missing tensor {key!r}")
    t = np.asarray(tensors[key])
    if t.shape != tuple(shape):
        expected = (f"expected {shape}" if field is None
                    else f"but config.json field {field!r} implies {shape}")
        raise CheckpointError(f"{source}: tensor {key!r} has shape {t.shape}, {expected}")
    return t


__all__ = ["CheckpointError", "ExportError", "checked_tensor"]
