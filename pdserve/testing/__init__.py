"""Harnesses for tests and benchmarks that need more than one process or host."""
