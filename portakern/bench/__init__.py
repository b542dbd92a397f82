"""Benchmark harness (see the benchmark issue)."""
