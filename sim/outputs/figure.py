"""Figures of one run drawn the cheap way: a matplotlib Figure on the Agg canvas (no pyplot, so no
global figure state and nothing to close), laid out once, drawn once, cropped and written as a PNG.

Why: `savefig(bbox_inches="tight")` draws a figure twice (once to measure, once to render) and
`tight_layout()` measures every axis once more; on the 13-axes dashboard that was two thirds of its
cost. Here a figure is drawn exactly once at the PNG's dpi, and `save_png` crops the rendered pixels
to what is not background, plus savefig's pad, which is what the tight bounding box does, without the
second draw.

- `new_figure(figsize)` keeps matplotlib's default layout of a `figsize` figure (its axes keep their
  size and place in inches) on a canvas BLEED inches larger on every side, so the labels the default
  layout puts past the figure's edge, which the tight box used to take in, are drawn and kept.
- `grid` lays out panels by margins in inches instead of `tight_layout` (the dashboard).
- Titles sit on their axes' top edge (STYLE, applied by the `styled` decorator to the functions that
  build figures): none of these figures has tick labels above an axis, and matplotlib's search for
  them was half of the dashboard's draw. The one thing that could still collide, a y axis offset
  text ("1e6") under a wide title, is checked after the draw and the title lifted as matplotlib
  would (a second draw, only then).
- Should anything still reach the canvas's edge, `save_png` falls back to savefig's tight box (the
  second draw), so nothing is ever cut off.

Invariant: what a person sees is what `savefig(dpi, bbox_inches="tight")` showed: the same artists,
sizes in points and dpi; only the white border is cut from pixels instead of from artist extents.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib as mpl
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.image import imsave

BLEED = 0.6  # inches of canvas around the nominal figure, for labels drawn past its edge
PAD_INCHES = mpl.rcParams["savefig.pad_inches"]  # kept around the content, as bbox_inches="tight" does
STYLE = {"axes.titley": 1.0}  # titles on the axes' top edge: no search for tick labels above it


def styled(build):
    """Decorate a function that builds a figure: its axes get STYLE."""
    return mpl.rc_context(STYLE)(build)


def new_figure(figsize: tuple[float, float], bleed: float = BLEED) -> Figure:
    """An empty `figsize` figure with matplotlib's default subplot layout, on its own Agg canvas
    `bleed` inches larger on every side (save_png crops it to the content)."""
    width, height = figsize
    fig = Figure(figsize=(width + 2 * bleed, height + 2 * bleed))
    fig.bleed = bleed
    FigureCanvasAgg(fig)
    rc = mpl.rcParams
    fig.subplots_adjust(left=_along(rc["figure.subplot.left"], width, bleed),
                        right=_along(rc["figure.subplot.right"], width, bleed),
                        bottom=_along(rc["figure.subplot.bottom"], height, bleed),
                        top=_along(rc["figure.subplot.top"], height, bleed))
    return fig


def _along(fraction: float, size: float, bleed: float) -> float:
    """A fraction of the nominal figure as a fraction of the canvas around it."""
    return (bleed + fraction * size) / (size + 2 * bleed)


def suptitle(fig: Figure, text: str, y: float = 0.98, **kwargs):
    """The figure's title at `y` of the nominal figure (matplotlib's default place)."""
    bleed = getattr(fig, "bleed", 0.0)
    height = fig.get_size_inches()[1]
    return fig.suptitle(text, y=_along(y, height - 2 * bleed, bleed), **kwargs)


def grid(fig: Figure, rows: int, cols: int, *, left: float, right: float, top: float, bottom: float,
         wgap: float = 0.0, hgap: float = 0.0, **subplots):
    """`fig.subplots(rows, cols)` placed by fixed margins around the nominal figure and gaps between
    panels, all in inches (instead of tight_layout, which measures every axis once more)."""
    width, height = fig.get_size_inches()
    left, right, top, bottom = (margin + getattr(fig, "bleed", 0.0) for margin in (left, right, top, bottom))
    panel_w = (width - left - right - (cols - 1) * wgap) / cols
    panel_h = (height - top - bottom - (rows - 1) * hgap) / rows
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                        wspace=wgap / panel_w, hspace=hgap / panel_h)
    return fig.subplots(rows, cols, **subplots)


def save_png(fig: Figure, path, dpi: float) -> Path:
    """Draw `fig` once at `dpi`, crop it to its content plus PAD_INCHES, write it as a PNG."""
    fig.set_dpi(dpi)
    fig.canvas.draw()
    if _lift_titles(fig):
        fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())
    background = np.round(np.asarray(fig.get_facecolor()) * 255).astype(np.uint8)
    ink = (rgba != background).any(axis=2)
    rows, cols = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
    if not len(rows) or rows[0] == 0 or cols[0] == 0 or rows[-1] == ink.shape[0] - 1 or cols[-1] == ink.shape[1] - 1:
        fig.savefig(path, dpi=dpi, bbox_inches="tight")  # something reaches the edge: measure it properly
        return Path(path)
    pad = int(round(PAD_INCHES * dpi))
    top, bottom = max(rows[0] - pad, 0), min(rows[-1] + pad + 1, ink.shape[0])
    left, right = max(cols[0] - pad, 0), min(cols[-1] + pad + 1, ink.shape[1])
    imsave(path, rgba[top:bottom, left:right], format="png", dpi=dpi)
    return Path(path)


def _lift_titles(fig: Figure) -> bool:
    """Lift each title that a visible y axis offset text of its axes (or their twins) overlaps to just
    above it, as matplotlib's own title placement does; True when one moved."""
    renderer = fig.canvas.get_renderer()
    moved = False
    for ax in fig.axes:
        titles = [t for t in (ax.title, ax._left_title, ax._right_title) if t.get_text()]
        bounds = ax.get_position().bounds
        for other in (o for o in fig.axes if o.get_position().bounds == bounds):
            offset = other.yaxis.offsetText
            if not (titles and offset.get_visible() and offset.get_text()):
                continue
            box = offset.get_window_extent(renderer)
            for title in titles:
                if box.overlaps(title.get_window_extent(renderer)):
                    title.set_y(ax.transAxes.inverted().transform((0, box.ymax))[1])
                    moved = True
    return moved
