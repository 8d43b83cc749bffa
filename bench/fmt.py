"""How the suite writes numbers in its table, targets and progress lines; None (not measured) is "n/a".

    python -c "from bench.fmt import times; print(times(2.345))"    # 2.35x
"""

from __future__ import annotations


def num(v, spec: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, spec)


def times(v) -> str:
    """A ratio: 2.35x."""
    return "n/a" if v is None else f"{v:.2f}x"


def pct(v) -> str:
    """A fraction as a percentage: 0.031 -> 3.1%."""
    return "n/a" if v is None else f"{100 * v:.1f}%"


def sec(v) -> str:
    return "n/a" if v is None else f"{v:.2f} s"


def phase(row: dict, key: str) -> str:
    """A row's breakdown entry `key` in seconds, or nothing where it has none."""
    b = row.get("breakdown") or {}
    return sec(b.get(key)) if b.get(key) is not None else ""
