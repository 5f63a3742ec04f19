"""Pallas kernels for DSpark decoding: Markov-head sampling and speculative verification."""
