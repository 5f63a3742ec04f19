"""Deprecated alias of `dspark_jax.decoding.speculative_round` (the speculative round, SPEC §1,
§8–9), kept only for `dspark_jax/aot/decode.py` until it imports the new module (and
`SlotSettings`, formerly `Params`); then delete this file."""

from dspark_jax.decoding.speculative_round import (EngineState, SlotSettings, draft_and_schedule,
                                                   prefill_chunk, verify_and_commit)

Params = SlotSettings

__all__ = ["EngineState", "Params", "SlotSettings", "draft_and_schedule", "prefill_chunk",
           "verify_and_commit"]
