"""The scheduler's functions (`dspark_jax.decoding.scheduler`) with the built-in modes addressed
by the names users pass (`serving.modes`): the tests' shorthand. `schedule_lengths(name, …)`
is that mode's device `schedule`; the name lists are read from the mode objects' traits."""

from __future__ import annotations

from typing import Any

import jax

from dspark_jax.decoding.scheduler import *  # noqa: F401,F403  (the primitives as they are)
from dspark_jax.serving.modes import BUILTIN_MODES, Production, mode_names, scheduler_mode

MODES = mode_names()
CONFIDENCE_MODES = tuple(m.name for m in BUILTIN_MODES if m.needs_confidence)
# the modes whose K comes from confidences two rounds old (the §5.2 schedule)
STALE_CAPACITY_MODES = tuple(m.name for m in BUILTIN_MODES if isinstance(m, Production))


def schedule_lengths(name: str, *args: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The device schedule of the built-in mode `name` (`SchedulerMode.schedule`)."""
    return scheduler_mode(name).schedule(*args)
