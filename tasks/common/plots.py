"""Plot helpers shared by the steps that draw against tokens seen (loss, evaluation curves, ablation probes)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from PIL import Image
from pydantic import BaseModel, ConfigDict

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


def use_readable_log_axis(ax: Any, ticks: int = 5) -> None:
    """A log-scale y axis labelled at `ticks` plain numbers spread over what it shows (320, 450, 640): matplotlib's
    own labels a narrow range at every minor tick in scientific notation (3x10^2, 4x10^2, ...) over each other."""
    import numpy as np
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ax.set_yscale("log")
    low, high = sorted(v for v in ax.get_ylim())
    if not (low > 0 and high > low):
        return
    spread = [float(f"{v:.2g}") for v in np.geomspace(low, high, ticks + 2)[1:-1]]
    ax.yaxis.set_major_locator(FixedLocator(sorted(set(spread))))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}" if v >= 100 else f"{v:.3g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(low, high)


PLOT_KEY = "compass:plot"  # the PNG text chunk that describes what a plot draws


class Series(BaseModel):
    model_config = ConfigDict(frozen=True)

    label: str
    x: tuple[float, ...]
    y: tuple[float, ...]


class Panel(BaseModel):
    """One axes of a figure, as drawn: titles, scale, its lines (series) and its bars (label -> height)."""

    model_config = ConfigDict(frozen=True)

    title: str
    xlabel: str
    ylabel: str
    yscale: str
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    series: tuple[Series, ...]
    bars: dict[str, float]
    texts: tuple[str, ...] = ()  # what is written on the axes (a bar's verdict, a threshold's name)
    yticks: tuple[str, ...] = ()  # the y axis's labels as drawn (minor ticks' included: empty ones left out)
    thresholds: dict[str, float] = {}  # horizontal lines across the axes, by label (a success criterion's)

    @property
    def outside(self) -> list[str]:
        """What the panel holds but does not show: points and bar tops beyond its axes' limits (an empty-looking
        plot whose data is all there)."""
        (x0, x1), (y0, y1) = sorted(self.xlim), sorted(self.ylim)
        shown = [f"{s.label} at ({x:g}, {y:g})" for s in self.series for x, y in zip(s.x, s.y, strict=True)
                 if math.isfinite(x) and math.isfinite(y) and not (x0 <= x <= x1 and y0 <= y <= y1)]
        return shown + [f"bar {label} {height:g}" for label, height in self.bars.items()
                        if math.isfinite(height) and not y0 <= height <= y1]


class PlotDescription(BaseModel):
    model_config = ConfigDict(frozen=True)

    title: str
    panels: tuple[Panel, ...]

    @classmethod
    def read(cls, png: Path | bytes) -> PlotDescription:
        """The description a PNG written by `figure_png` carries (PIL reads PNG text chunks)."""

        with Image.open(io.BytesIO(png) if isinstance(png, bytes) else png) as image:
            return cls.model_validate_json(image.text[PLOT_KEY])


def describe(fig: Any) -> PlotDescription:
    """What the figure draws, read back from matplotlib's own artists (not from the data handed to it): a plot that
    lost a series, a point or a bar shows it here."""
    panels = []
    for ax in fig.axes:
        if not ax.axison:
            continue
        lines = [line for line in ax.get_lines() if not str(line.get_label()).startswith("_")]
        spanning = [line for line in lines if line.get_transform() == ax.get_yaxis_transform()]  # axhline
        series = tuple(Series(label=str(line.get_label()), x=tuple(float(v) for v in line.get_xdata()),
                              y=tuple(float(v) for v in line.get_ydata()))
                       for line in lines if line not in spanning)
        thresholds = {str(line.get_label()): float(line.get_ydata()[0]) for line in spanning}
        bars: dict[str, float] = {}
        for container in ax.containers:
            patches = getattr(container, "patches", None)
            if patches:
                labels = [t.get_text() for t in ax.get_xticklabels()]
                bars.update({labels[i] if i < len(labels) else str(i): float(p.get_height())
                             for i, p in enumerate(patches)})
        panels.append(Panel(title=ax.get_title(), xlabel=ax.get_xlabel(), ylabel=ax.get_ylabel(),
                            yscale=ax.get_yscale(), xlim=tuple(float(v) for v in ax.get_xlim()),
                            ylim=tuple(float(v) for v in ax.get_ylim()), series=series, bars=bars,
                            texts=tuple(t.get_text() for t in ax.texts), thresholds=thresholds,
                            yticks=_tick_labels(ax)))
    title = fig._suptitle.get_text() if fig._suptitle is not None else ""  # noqa: SLF001 - matplotlib's own field
    return PlotDescription(title=title, panels=tuple(panels))


def _tick_labels(ax: Any) -> tuple[str, ...]:
    """The y labels the axes draw within its limits, major and minor, as the formatters write them."""
    low, high = sorted(ax.get_ylim())
    shown = []
    for which, formatter in ((False, ax.yaxis.get_major_formatter()), (True, ax.yaxis.get_minor_formatter())):
        values = [v for v in ax.yaxis.get_ticklocs(minor=which) if low <= v <= high]
        if hasattr(formatter, "set_locs"):
            formatter.set_locs(values)
        shown += [label for v in values if (label := formatter(v))]
    return tuple(shown)


def figure_png(fig: Any, dpi: int) -> bytes:
    """The figure as PNG bytes, carrying its description (`PlotDescription.read`); the figure is closed."""
    import matplotlib.pyplot as plt

    fig.canvas.draw()  # tick labels exist once drawn
    description = describe(fig).model_dump_json()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, metadata={PLOT_KEY: description})
    plt.close(fig)
    return buffer.getvalue()
