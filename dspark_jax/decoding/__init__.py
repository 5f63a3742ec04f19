"""Decoding: the device code of plain and speculative decoding (SPEC §1, §3, §8–9; paper §2,
§3.2, §5.2–5.3): the speculative round (`speculative_round`: draft → schedule → verify →
commit), the scheduler (`scheduler`), the acceptance rule (`acceptance_rule`), Markov head
sampling (`markov_sampling`), token sampling (`sampling`), stop tokens (`stops`), the drafter
adapters (`draft_adapters`) and plain autoregressive decoding (`autoregressive`). The host side
(the engine, `speculative_generate`) is `dspark_jax.serving`."""

from dspark_jax.decoding.autoregressive import autoregressive_generate

__all__ = ["autoregressive_generate"]
