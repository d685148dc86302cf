"""The book's plotting style and helpers: one look for every figure, saved and shown in one call."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from .. import _io

__all__ = ["set_style", "save_and_show", "smallest_text", "scatter_features", "image_grid", "CLASS_PALETTE",
           "PHONE_COLUMN_PX", "LEGIBLE_PX"]

CLASS_PALETTE = "tab10"
PHONE_COLUMN_PX = 358  # the book's text column on a 390-pixel phone, in CSS pixels (tests/test_browser.py)
LEGIBLE_PX = 6.0  # the smallest text a figure may show at that width: about a 9-point label on a 5-inch plot


def set_style() -> None:
    """Seaborn's clean 'ticks' style with the book's font sizes and a fixed palette (matplotlib's defaults with
    the same palette where seaborn is not installed, as on a bare GPU box running a chapter as a script)."""
    try:
        import seaborn as sns
    except ImportError:
        plt.rcParams["axes.prop_cycle"] = plt.cycler(color=plt.get_cmap(CLASS_PALETTE).colors)
    else:
        sns.set_theme(context="notebook", style="ticks", palette=CLASS_PALETTE, font_scale=0.95)
    plt.rcParams.update({
        "figure.dpi": 100, "savefig.dpi": 150, "savefig.bbox": "tight",
        "axes.spines.top": False, "axes.spines.right": False, "figure.autolayout": False,
    })


def save_and_show(fig: plt.Figure, path: str | Path, show: bool = True, glue_as: str | None = None) -> Path:
    """Save ``fig`` to ``path`` (PNG unless the suffix says otherwise), then display and close it.

    With ``glue_as``, a notebook executed for the book (``$SPHEREML_GLUE_FIGURES`` is 1: ``make book``,
    ``make book-smoke`` and the tests that seed their cache set it) stores the figure with myst-nb's glue
    under that key instead of showing it in the cell: a ``{glue:figure}`` directive in the text places it
    with its numbered caption, so the code cell keeps only its printed output.  Everywhere else (a reader's
    Jupyter or Colab session, ``python -m sphereml.book run``) the figure is shown as usual.
    """
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")
    with _io.atomic_path(path) as tmp:  # a killed run leaves the old figure or the new one, never half of one
        fig.savefig(tmp, format=path.suffix[1:])
    if show and not (glue_as and _glue(glue_as, fig)):
        plt.show()
    plt.close(fig)
    return path


def smallest_text(fig: plt.Figure, column_px: float = PHONE_COLUMN_PX) -> dict:
    """The figure's smallest visible text and its height once the book fits the figure to a column.

    A figure saved at ``savefig.dpi`` is ``width_in * dpi`` pixels wide; a page shows it at that size or, when
    wider, shrunk to the column, so a ``pt``-point label appears ``pt / 72 * dpi * min(1, column_px / (width_in
    * dpi))`` pixels tall.  Returns ``{"width_in", "smallest_pt", "text", "px"}`` (``px`` at ``column_px``), the
    numbers :data:`LEGIBLE_PX` is checked against.
    """
    renderer = fig.canvas.get_renderer()
    width_in = fig.get_tightbbox(renderer).width
    texts = list(_drawn_texts(fig))
    if not texts:
        return {"width_in": round(width_in, 2), "smallest_pt": None, "text": None, "px": None}
    small = min(texts, key=lambda t: t.get_fontsize())
    dpi = plt.rcParams["savefig.dpi"]
    dpi = fig.dpi if dpi == "figure" else float(dpi)
    px = small.get_fontsize() / 72 * dpi * min(1.0, column_px / (width_in * dpi))
    return {"width_in": round(width_in, 2), "smallest_pt": round(float(small.get_fontsize()), 1),
            "text": small.get_text()[:40], "px": round(px, 1)}


def _drawn_texts(artist):
    """The non-empty texts an artist draws: invisible artists, and the axis lines, ticks and labels of axes
    turned off, draw nothing."""
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.text import Text

    if not artist.get_visible():
        return
    if isinstance(artist, Text) and artist.get_text().strip():
        yield artist
    children = artist.get_children()
    if isinstance(artist, Axes) and not artist.axison:
        children = [c for c in children if not isinstance(c, Axis)]
    for child in children:
        yield from _drawn_texts(child)


def _glue(key: str, fig: plt.Figure) -> bool:
    """Glue ``fig`` under ``key`` in a notebook executed for the book; True if glued."""
    if os.environ.get("SPHEREML_GLUE_FIGURES") != "1":
        return False
    try:
        from IPython import get_ipython
        from myst_nb import glue
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return False
    glue(key, fig, display=False)
    return True


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def scatter_features(ax, features, labels, class_names=None, s: float = 3.0, alpha: float = 0.5, unit_circle=False):
    """Scatter 2-D features coloured by class, with the origin marked (thesis Fig. 1.3 / 2.2 style)."""
    f, y = _np(features), _np(labels)
    if f.ndim != 2 or f.shape[1] != 2:
        raise ValueError(f"features must be Tensor[N, 2], got shape {f.shape}")
    cmap = plt.get_cmap(CLASS_PALETTE)
    for c in np.unique(y):
        name = class_names[c] if class_names is not None else str(c)
        ax.scatter(*f[y == c].T, s=s, alpha=alpha, color=cmap(int(c) % 10), label=name, rasterized=True)
    ax.axhline(0, color="0.7", lw=0.6, zorder=0)
    ax.axvline(0, color="0.7", lw=0.6, zorder=0)
    if unit_circle:
        t = np.linspace(0, 2 * np.pi, 200)
        ax.plot(np.cos(t), np.sin(t), color="0.3", lw=0.8)
    ax.set_aspect("equal", adjustable="datalim")
    return ax


def image_grid(ax, images, nrow: int, pad: int = 1, vmin: float = 0.0, vmax: float = 1.0, pad_color="black"):
    """Show images Tensor[N, 1, H, W] as one grey grid with ``nrow`` images per row (``vmin`` white, ``vmax``
    black), separated by ``pad`` pixels of ``pad_color`` — choose one that no value can take when black and
    white both carry meaning (kernels scaled to their own range)."""
    x = _np(images)
    if x.ndim != 4 or x.shape[1] != 1:
        raise ValueError(f"images must be Tensor[N, 1, H, W], got shape {x.shape}")
    n, _, h, w = x.shape
    ncol = nrow
    nrows = int(np.ceil(n / ncol))
    grid = np.full((nrows * (h + pad) + pad, ncol * (w + pad) + pad), np.nan, dtype=np.float32)
    for i in range(n):
        r, c = divmod(i, ncol)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = x[i, 0]
    ax.imshow(np.ma.masked_invalid(grid), cmap=plt.get_cmap("gray_r").with_extremes(bad=pad_color), vmin=vmin,
              vmax=vmax)
    ax.set_xticks([])
    ax.set_yticks([])
    return ax
