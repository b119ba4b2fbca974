"""Plot helpers shared by the steps that draw against tokens seen (loss, evaluation curves, ablation probes)."""

from __future__ import annotations

from typing import Any

UNITS = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


def token_axis(n: float) -> str:
    """A token count people read at a glance: 200k, 1.2M, 3.4T (tick labels that never run into each other)."""
    for unit, suffix in UNITS:
        if abs(n) >= unit:
            return f"{n / unit:.3g}{suffix}"
    return f"{n:.3g}"


def use_token_axis(ax: Any) -> None:
    """x ticks in token units (at most 6 of them)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: token_axis(x)))
