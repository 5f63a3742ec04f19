"""The confidence-calibration file of a drafter directory (paper §3.2.1 "Post-hoc Calibration",
Sequential Temperature Scaling; SPEC §7).

`<draft dir>/confidence_calibration.json` (format ``dspark_jax.sts.v1``) holds one temperature
per draft slot for the confidence head's logits. `python -m dspark_jax.calibrate` fits them
(dspark_jax.eval.calibration) and writes the file with :func:`save_temperatures`; the drafter
loader (models/drafters/draft.py) reads it with :func:`load_temperatures` into
``Draft.confidence_temperatures``. Reading and writing live here, beside the drafter's other
checkpoint files, so the model layer never imports the evaluation layer.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from dspark_jax.models.io.errors import CheckpointError

__all__ = ["CALIBRATION_FILE", "CALIBRATION_FORMAT", "CalibrationFileError", "save_temperatures",
           "load_temperatures"]

#: File name of the fitted per-slot temperatures inside a drafter directory.
CALIBRATION_FILE = "confidence_calibration.json"
#: Value of its "format" field.
CALIBRATION_FORMAT = "dspark_jax.sts.v1"


class CalibrationFileError(CheckpointError):
    """A confidence_calibration.json that is malformed or does not fit the drafter."""


def _calibration_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / CALIBRATION_FILE if p.is_dir() else p


def _check_temperatures(temps: Any, gamma: int | None, source: str) -> tuple[float, ...]:
    if not isinstance(temps, (list, tuple)) or not temps:
        raise CalibrationFileError(f"{source}: field 'temperatures' must be a non-empty list of "
                                   f"numbers, got {temps!r}")
    out = []
    for i, t in enumerate(temps):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise CalibrationFileError(f"{source}: field 'temperatures[{i}]' must be a finite "
                                       f"number > 0, got {t!r}")
        out.append(float(t))
    if gamma is not None and len(out) != gamma:
        raise CalibrationFileError(f"{source}: field 'temperatures' has {len(out)} entries but the "
                                   f"drafter has γ = {gamma} draft slots")
    return tuple(out)


def save_temperatures(
    path: str | os.PathLike,  # drafter directory (or the file itself)
    temperatures: Sequence[float],
    *,
    before: Mapping[str, Any] | None = None,
    after: Mapping[str, Any] | None = None,
    num_rounds: Any = None,
    data: Mapping[str, Any] | None = None,
) -> Path:
    """Writes ``confidence_calibration.json`` atomically (temp file + rename); returns its path.

    ``before`` / ``after`` are the held-out metrics without / with the temperatures, ``data``
    says what the rounds came from; all three are recorded, only ``temperatures`` is read back.
    """
    dest = _calibration_path(path)
    temps = _check_temperatures([float(t) for t in temperatures], None, str(dest))
    doc = {"format": CALIBRATION_FORMAT, "gamma": len(temps), "temperatures": list(temps),
           "before": dict(before or {}), "after": dict(after or {}), "num_rounds": num_rounds,
           "data": dict(data or {})}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False), encoding="utf-8")
    os.replace(tmp, dest)
    return dest


def load_temperatures(path: str | os.PathLike, gamma: int | None = None
                      ) -> tuple[float, ...] | None:
    """Per-slot temperatures from a drafter directory (or the file); None when there is no file.

    With ``gamma``, the file must hold exactly that many.  Raises :class:`CalibrationFileError`
    naming the file and the field for anything malformed.
    """
    src = _calibration_path(path)
    if not src.is_file():
        return None
    try:
        doc = json.loads(src.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CalibrationFileError(f"{src}: not a readable JSON file ({e})") from None
    if not isinstance(doc, dict):
        raise CalibrationFileError(f"{src}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != CALIBRATION_FORMAT:
        raise CalibrationFileError(f"{src}: field 'format' must be {CALIBRATION_FORMAT!r}, got "
                                   f"{doc.get('format')!r}")
    temps = _check_temperatures(doc.get("temperatures"), gamma, str(src))
    g = doc.get("gamma")
    if isinstance(g, bool) or not isinstance(g, int) or g != len(temps):
        raise CalibrationFileError(f"{src}: field 'gamma' ({g!r}) must be an int equal to the "
                                   f"number of temperatures ({len(temps)})")
    return temps
