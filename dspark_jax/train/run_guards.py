"""What keeps a long training run safe on pre-emptible machines: the count of non-finite steps
(`NonFiniteGuard`) and the pre-emption notice (`PreemptionWatch`), both checked by the training
loop (train_stage.py) between steps.

Non-finite steps: the jitted step (step.py) leaves the params, optimizer state and RNG key as
they were when the loss or gradient norm is not finite and reports `nonfinite` = 1. The guard
reads that flag one step late (after the next step is dispatched, so checking never stalls the
device), logs each such step once with its batch fingerprint, counts them (`total`, saved with
every checkpoint) and says when `train.max_nonfinite_steps` came in a row.

Pre-emption: a single process installs a SIGTERM handler that only sets a flag, so the loop
saves a checkpoint at the end of the current step and returns; a second SIGTERM during that save
changes nothing. Processes of a multi-process run (`jax.distributed`) use JAX's coordination
service instead: it receives the SIGTERM of any process and
`multihost_utils.reached_preemption_sync_point` (through Orbax's `reached_preemption`) turns true
at the same step on every process, so all of them save that step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from typing import Any, Callable

log = logging.getLogger(__name__)


class NonFiniteStepsError(RuntimeError):
    """`train.max_nonfinite_steps` steps in a row had a non-finite loss or gradient norm."""


@dataclasses.dataclass
class NonFiniteGuard:
    """Counts the steps the jitted step skipped (`metrics["nonfinite"]`). `defer` one step's
    flag, `resolve` it later (it then fetches the flag); `tripped` from the step that made
    `max_in_a_row` in a row on (`tripped_at`), even if a later step was finite."""

    max_in_a_row: int
    total: int = 0
    in_a_row: int = 0
    write: Callable[[str], None] = print
    tripped_at: int | None = None
    _pending: tuple[int, Any, str] | None = None

    def defer(self, step: int, flag: Any, fingerprint: str) -> None:
        """Step `step`'s `nonfinite` flag (a device scalar) and its batch fingerprint; the
        previous deferred one is resolved first."""
        self.resolve()
        self._pending = (step, flag, fingerprint)

    def resolve(self) -> None:
        if self._pending is None:
            return
        import numpy as np

        step, flag, fingerprint = self._pending
        self._pending = None
        if not int(np.asarray(flag)):
            self.in_a_row = 0
            return
        self.total += 1
        self.in_a_row += 1
        self.write(f"step {step}: non-finite loss or gradient norm, update skipped (batch "
                   f"{fingerprint}; {self.in_a_row} in a row, {self.total} in this run)")
        if self.in_a_row >= self.max_in_a_row and self.tripped_at is None:
            self.tripped_at = step

    @property
    def tripped(self) -> bool:
        return self.tripped_at is not None

    def counters(self) -> dict[str, int]:
        """What a checkpoint keeps of the count (resolve first)."""
        return {"nonfinite_steps": self.total, "nonfinite_in_a_row": self.in_a_row}

    def error(self, saved: str) -> NonFiniteStepsError:
        last = self.tripped_at
        return NonFiniteStepsError(
            f"stopped at step {last}: steps {last - self.max_in_a_row + 1}-{last} all had a "
            f"non-finite loss or gradient norm (config.train.max_nonfinite_steps = "
            f"{self.max_in_a_row}); the last good parameters are saved in {saved}. Lower "
            "config.train.lr or check those batches (fingerprints in the log), then re-run")


def distributed_client_active() -> bool:
    """Whether `jax.distributed` is initialised (its coordination service then owns SIGTERM)."""
    import jax

    try:
        from jax._src import distributed

        return distributed.global_state.client is not None
    except (ImportError, AttributeError):
        return jax.process_count() > 1


class PreemptionWatch:
    """`reached(step)` after every step: True when the run should save and stop (module
    docstring). `close()` puts the previous SIGTERM handler back."""

    def __init__(self, manager: Any | None = None):
        self._manager = manager
        self._multi = manager is not None and distributed_client_active()
        self._flag = False
        self._previous: Any = None
        if not self._multi:
            try:
                self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            except ValueError:   # not the main thread: leave SIGTERM to its default
                log.warning("not in the main thread: SIGTERM will not save a checkpoint")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        again = self._flag
        self._flag = True
        # os.write, not print: a handler may run while the main thread is inside a print
        os.write(2, (b"SIGTERM again: the checkpoint save goes on\n" if again else
                     b"SIGTERM: saving a checkpoint at the end of this step, then exiting\n"))

    def reached(self, step: int) -> bool:
        if self._multi:
            return bool(self._manager.reached_preemption(step))
        return self._flag

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
