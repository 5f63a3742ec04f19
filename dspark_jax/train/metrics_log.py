"""Training progress and metrics sinks (SPEC §4 "Metrics"; DeepSpec logs the same quantities).

`MetricsLogger` fans one metrics dict per step out to a tqdm progress bar with ETA, a TensorBoard
event file (tensorboardX; tags `train/<name>` exactly as DeepSpec's, see losses.py and
eagle3_loss.py for the names) and a JSONL file (`metrics.jsonl`, one object per line, appended so
that a resumed run continues the same file). Besides the step's losses, accept_rate@k,
tau_probabilistic, lr and grad norm it records tokens/s and, on every step, a fingerprint of the
batch that step consumed (`batch_hash`), which is how a resumed run is checked to have seen the
same data as an uninterrupted one. Only process 0 writes.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Any, Mapping

import numpy as np

from dspark_jax.eval.report_numbers import json_float

PROGRESS_KEYS = ("loss", "accept_rate@0", "tau_probabilistic", "lr")


def _scalar(v: Any) -> float | None:
    """A metric as a JSON number: None when it is not a scalar number or not finite."""
    try:
        x = float(np.asarray(v))
    except (TypeError, ValueError):
        return None
    return json_float(x)


class MetricsLogger:
    """tqdm + TensorBoard + JSONL. `log(step, metrics, tokens=…, batch_hash=…)` once per step."""

    def __init__(self, workdir: str | os.PathLike, total_steps: int, start_step: int = 0, *,
                 enabled: bool = True, progress: bool = True, tensorboard: bool = True,
                 jsonl: bool = True, desc: str = "train"):
        self.workdir = pathlib.Path(workdir)
        self.total_steps, self.start_step = int(total_steps), int(start_step)
        self.enabled = enabled
        self.jsonl_path = self.workdir / "metrics.jsonl"
        self.tb_dir = self.workdir / "tensorboard"
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._t0 = time.perf_counter()
        self._t_last = self._t0
        self._tokens_since = 0
        self._tokens_total = 0
        self._steps_done = 0
        self.last: dict[str, float] = {}
        if not enabled:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.tb_dir))
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total_steps, initial=self.start_step, desc=desc,
                             unit="step", dynamic_ncols=True, file=sys.stderr)

    def log(self, step: int, metrics: Mapping[str, Any] | None = None, *, tokens: int = 0,
            batch_hash: str | None = None, **extra: Any) -> None:
        """Records step `step` (1-based: the number of optimizer updates done). `metrics` may be
        None on steps whose device metrics are not fetched (only the fingerprint is written)."""
        self._tokens_since += int(tokens)
        self._tokens_total += int(tokens)
        self._steps_done += 1
        if not self.enabled:
            return
        rec: dict[str, Any] = {"step": int(step)}
        if batch_hash is not None:
            rec["batch_hash"] = batch_hash
        if metrics is not None:
            now = time.perf_counter()
            dt = max(now - self._t_last, 1e-9)
            values = {k: _scalar(v) for k, v in metrics.items()}
            values["tokens_per_s"] = self._tokens_since / dt
            self._t_last, self._tokens_since = now, 0
            rec.update(values)
            self.last = {k: v for k, v in values.items() if v is not None}
            if self._tb is not None:
                for k, v in self.last.items():
                    self._scalar(f"train/{k}", v, step)
            if self._bar is not None:
                self._bar.set_postfix({k: f"{self.last[k]:.4g}" for k in PROGRESS_KEYS
                                       if k in self.last}, refresh=False)
        rec.update(extra)
        rec["time"] = round(time.time(), 3)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        if self._bar is not None:
            self._bar.update(max(0, int(step) - self._bar.n))

    def log_eval(self, step: int, metrics: Mapping[str, Any], prefix: str = "heldout") -> None:
        if not self.enabled:
            return
        values = {k: _scalar(v) for k, v in metrics.items()}
        if self._tb is not None:
            for k, v in values.items():
                if v is not None:
                    self._scalar(f"{prefix}/{k}", v, step)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": int(step), "split": prefix, **values}) + "\n")
            self._jsonl.flush()

    def _scalar(self, tag: str, value: float, step: int) -> None:
        """A scalar under exactly `tag` (DeepSpec's, e.g. train/accept_rate@0): tensorboardX's
        add_scalar would rewrite '@' to '_', torch's SummaryWriter (DeepSpec's) does not."""
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self._tb._get_file_writer().add_summary(summary, step)

    def write(self, msg: str) -> None:
        """A message that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def summary_line(self) -> str:
        elapsed = time.perf_counter() - self._t0
        parts = [f"{self._steps_done} steps in {elapsed:.1f}s",
                 f"{self._tokens_total / max(elapsed, 1e-9):.0f} tok/s"]
        for k in ("loss", "accept_rate@0", "tau_probabilistic", "grad_norm"):
            if k in self.last:
                parts.append(f"{k}={self.last[k]:.4g}")
        return "done: " + ", ".join(parts)

    def close(self, final: bool = True) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if final and self.enabled:
            print(self.summary_line(), flush=True)
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
