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
                            texts=tuple(t.get_text() for t in ax.texts), thresholds=thresholds))
    title = fig._suptitle.get_text() if fig._suptitle is not None else ""  # noqa: SLF001 - matplotlib's own field
    return PlotDescription(title=title, panels=tuple(panels))


def figure_png(fig: Any, dpi: int) -> bytes:
    """The figure as PNG bytes, carrying its description (`PlotDescription.read`); the figure is closed."""
    import matplotlib.pyplot as plt

    fig.canvas.draw()  # tick labels exist once drawn
    description = describe(fig).model_dump_json()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, metadata={PLOT_KEY: description})
    plt.close(fig)
    return buffer.getvalue()
