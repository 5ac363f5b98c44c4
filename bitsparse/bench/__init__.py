"""Benchmark suites; run ``python -m bitsparse.bench --help``."""
