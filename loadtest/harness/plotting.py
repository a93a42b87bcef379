"""One matplotlib figure, drawn by the caller and written to a PNG."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def figure(path: Path, dpi: int, *grid: int, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """Yield ``(fig, axes)`` of ``plt.subplots(*grid, **subplots)``; on exit lay it out and save it to ``path``.

    matplotlib is imported here, on its file-only backend, so that a benchmark run
    without ``--plot`` (or on a machine without a display) never needs it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
