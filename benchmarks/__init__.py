"""The measurement tools beside their results: run from the repository root, e.g. python -m benchmarks.bench --help."""
