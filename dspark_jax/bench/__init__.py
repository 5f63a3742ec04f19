"""Benchmarks (scripts that print a table; speed is never asserted in tests)."""
