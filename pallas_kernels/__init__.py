"""Pallas kernels for DSpark: Markov-head sampling and speculative verification (decoding), and
the drafter's block attention over the target context (training)."""
