"""torch reshaped in one place: every private torch name elastic-mnist uses, string key names included, is
reached in private.py and checked when it is imported (the checks: checks.py).

    python -m elastic_mnist.compat    # prints each checked name, then OK (or the one mismatch)
"""
