"""Training: losses, train state and the jitted step, optimizer/schedule, checkpointing (SPEC §4–5)."""
