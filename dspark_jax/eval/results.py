"""Reading an evaluation back: the files `python -m dspark_jax.evaluate` writes (DeepSpec's
offline protocol, SPEC §6/§7) — `results.json`, the raw per-round `records.jsonl` and the
confidence logits `confidence.npz` — and the rounds of all datasets pooled in one order, the
order `evaluate`'s pooled calibration and the analysis notebook use.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["RESULTS_FILE", "RECORDS_FILE", "CONFIDENCE_FILE", "EvaluationRun", "load_results",
           "pooled_rounds", "write_rounds"]

RESULTS_FILE = "results.json"
RECORDS_FILE = "records.jsonl"
CONFIDENCE_FILE = "confidence.npz"


def pooled_rounds(records: Mapping[str, Sequence[Mapping[str, Any]]], names: Sequence[str],
                  confidence: Mapping[str, np.ndarray] | None = None
                  ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(confidence logits [R, γ] or None, proposed [R], accepted [R]) of every round of
    `names`' records, dataset by dataset, record by record: the row order of confidence.npz."""
    prop = np.asarray([x for n in names for r in records.get(n, ()) for x in r["proposed"]])
    acc = np.asarray([x for n in names for r in records.get(n, ()) for x in r["accepted"]])
    logits = None
    if confidence is not None:
        logits = np.concatenate([confidence[n] for n in names if n in confidence], axis=0)
    return logits, prop, acc


def write_rounds(out: Path, names: Sequence[str],
                 records: Mapping[str, Sequence[Mapping[str, Any]]],
                 confidence: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Writes records.jsonl (dataset by dataset) and, when there are confidence logits,
    confidence.npz; returns {"records": ..., "confidence": ...} (the files written)."""
    files = {"records": RECORDS_FILE}
    with open(out / RECORDS_FILE, "w", encoding="utf-8") as fh:
        for name in names:
            for rec in records[name]:
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    if confidence:
        np.savez(out / CONFIDENCE_FILE, **dict(confidence))
        files["confidence"] = CONFIDENCE_FILE
    return files


@dataclasses.dataclass
class EvaluationRun:
    """One evaluation's outputs: results.json, and the raw records / confidence logits when
    they are next to it (None otherwise)."""

    path: Path
    results: dict[str, Any]
    records: dict[str, list[dict[str, Any]]] | None
    confidence: dict[str, np.ndarray] | None

    @property
    def config(self) -> dict[str, Any]:
        return self.results["config"]

    @property
    def evaluated(self) -> list[str]:
        """The datasets with at least one decoded round, in the run's order."""
        ds = self.results["datasets"]
        return [n for n in self.config["datasets"] if ds[n]["rounds"] > 0]

    def pooled_rounds(self) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """`pooled_rounds` over all of the run's datasets (needs the raw records)."""
        if self.records is None:
            raise FileNotFoundError(f"{self.path.parent / RECORDS_FILE} not found: the raw "
                                    "per-round records are not next to results.json")
        return pooled_rounds(self.records, self.config["datasets"], self.confidence)


def load_results(path: str | Path) -> EvaluationRun:
    """Reads an evaluation from its results.json (or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `python -m dspark_jax.evaluate ... "
                                "--out DIR` and pass DIR/results.json")
    results = json.loads(path.read_text(encoding="utf-8"))
    rec_path, conf_path = path.parent / RECORDS_FILE, path.parent / CONFIDENCE_FILE
    records = None
    if rec_path.is_file():
        records = {n: [] for n in results["config"]["datasets"]}
        for line in rec_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                records.setdefault(rec["dataset"], []).append(rec)
    confidence = None
    if conf_path.is_file():
        with np.load(conf_path) as z:
            confidence = {n: z[n] for n in z.files}
    return EvaluationRun(path=path, results=results, records=records, confidence=confidence)
