"""What a benchmark writes: table cells and its JSON result file."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def fmt(value: float | None, spec: str, missing: str = "n/a") -> str:
    """``value`` formatted with ``spec`` for a table cell; ``missing`` where there is none."""
    return missing if value is None else format(value, spec)


def markdown_table(header: str | Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A markdown table, one line a row, no trailing newline.

    ``header`` is the column names, or one string of them separated by `` | ``.
    ``align`` has one letter a column, ``l`` (the default for a column it does
    not reach) or ``r``; cells are written with ``str`` and so are best
    formatted by the caller (:func:`fmt`).
    """
    return "\n".join([markdown_header(header, align), *(markdown_row(cells) for cells in rows)])


def markdown_header(header: str | Sequence[str], align: str = "") -> str:
    """The first two lines of :func:`markdown_table`, for a table printed a row at a time."""
    if isinstance(header, str):
        header = header.split(" | ")
    marks = [":" if align[i : i + 1] == "r" else "" for i in range(len(header))]
    return markdown_row(header) + "\n|" + "|".join(f"---{m}" for m in marks) + "|"


def markdown_row(cells: Sequence[object]) -> str:
    """One line of a markdown table."""
    return "| " + " | ".join(map(str, cells)) + " |"


def config_json(options: Any) -> dict[str, Any]:
    """A parsed command line as JSON values (paths as strings), to record how a result was made."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(options).items()}


def write_json(
    path: Path | str,
    payload: Mapping[str, Any],
    *,
    indent: int | None = 2,
    newline: bool = False,
    default: Callable[[Any], Any] | None = None,
    announce: bool = True,
) -> Path:
    """Write ``payload`` as JSON to ``path`` (its folder made when missing); returns the path.

    ``newline`` ends the file with one; ``announce`` prints ``wrote <path>``
    after a blank line, the last line of most benchmarks' output.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=indent, default=default) + ("\n" if newline else ""))
    if announce:
        print(f"\nwrote {out}")
    return out


def write_runs(options: Any, stem: str, runs: Iterable[Mapping[str, Any]], started: float) -> Path:
    """``<options.out_dir>/<stem>.json``: how the result was made (``config_json``), each run, and the
    wall time since ``started`` (``time.perf_counter()``); returns the path."""
    payload = {"config": config_json(options), "runs": list(runs), "wall_s": time.perf_counter() - started}
    return write_json(Path(options.out_dir) / f"{stem}.json", payload, announce=False)
