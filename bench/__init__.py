"""The benchmark suite: `python -m bench` (or `elastic-mnist bench`)."""
