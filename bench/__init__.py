"""The benchmark suite: `python -m bench` from a checkout (it is not installed with the package)."""
