"""Benchmarks of the freshness gate against the embedded broker and real worker processes.

Run from the project root, e.g. `.venv/bin/python -m bench.gate_overhead`; results go to
bench/results/<name>.json (and PNGs from `python -m bench.plot`).
"""
