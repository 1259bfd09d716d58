"""Matplotlib for the pictures: imported on demand, drawn on the Agg canvas, saved atomically as PNG or SVG."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from pyplan._files import write_atomic
from pyplan.errors import PlanError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["FORMATS", "figure_bytes", "new_figure", "picture_format", "save_figure", "time_unit"]

FORMATS = ("png", "svg")


def new_figure(width_in: float, height_in: float, *, what: str) -> Figure:
    """A Figure on its own Agg canvas (no pyplot, so no global backend or figure registry is touched).

    `what` names the picture in the error raised when matplotlib is missing.
    """
    try:  # optional: matplotlib (pip install 'pyplan[plot]'), only for pictures
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlanError(f"{what} needs matplotlib: pip install 'pyplan[plot]'") from None
    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def time_unit(seconds: float) -> tuple[float, str]:
    """The factor and name of the unit a time axis up to `seconds` reads best in: s, ms or µs."""
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def picture_format(path: str | Path) -> str:
    """The picture format, png or svg, from the suffix of the file name."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise PlanError(f"cannot tell the picture format of '{path}': name it .png or .svg")
    return fmt


def figure_bytes(fig: Figure, fmt: str, *, dpi: int = 150) -> bytes:
    """The figure encoded as PNG or SVG, without the creation date, so equal figures give equal bytes."""
    metadata = {"Software": None} if fmt == "png" else {"Date": None, "Creator": None}
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=dpi, metadata=metadata)
    return buf.getvalue()


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 150) -> None:
    """Write the figure to `path` (format from the suffix) through a temporary file: never a half-written picture."""
    write_atomic(path, figure_bytes(fig, picture_format(path), dpi=dpi))
