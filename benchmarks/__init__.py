"""Benchmark scripts (run as `.venv/bin/python benchmarks/<name>.py`; see each module docstring)."""
