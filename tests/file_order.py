"""Test files run longest first, so that the last file a worker takes is a short one.

``make test`` runs pytest-xdist with ``--dist loadfile --no-loadscope-reorder``: whole
files go to the workers as they free up, in the order collected. (xdist's own reorder
puts the files with the most tests first, which leaves the files of one or two
minute-long tests to the end, one worker running them while the other waits.) Here
the files are collected in the order of their last measured duration
(``tests/file_durations.json``, kept per ``-m`` selection: ``make test`` runs ``not slow``
and then ``slow``), longest first: the longest-processing-time rule,
under which a run ends at most one short file after an even split. A file without a
record goes first, as if it were the longest: a new file is never the one left running
alone at the end.

``--record-file-durations`` writes this run's seconds per file (setup, call and
teardown of its tests, summed) into the record of its selection; files this run did
not take keep theirs.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

RECORD = Path(__file__).with_name("file_durations.json")

_seconds: defaultdict[str, float] = defaultdict(float)


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _records() -> dict[str, dict[str, float]]:
    try:
        data = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(selection): {str(name): float(seconds) for name, seconds in files.items()}
        for selection, files in data.items()
        if isinstance(files, dict)
    }


def _selection(config: pytest.Config) -> str:
    return str(config.getoption("markexpr", "") or "")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-file-durations",
        action="store_true",
        help=f"write each test file's seconds in this run into {RECORD.name} (the order of later runs)",
    )


def longest_first(nodeids: Sequence[str], seconds: Mapping[str, float]) -> list[int]:
    """The order to run ``nodeids`` in, as indices: files without a record in ``seconds`` first, then
    the longest recorded; each file's tests together and in their collected order."""
    first: dict[str, int] = {}
    for i, nodeid in enumerate(nodeids):
        first.setdefault(_file_of(nodeid), i)

    def key(i: int) -> tuple[float, int, int]:
        name = _file_of(nodeids[i])
        return (-seconds.get(name, math.inf), first[name], i)

    return sorted(range(len(nodeids)), key=key)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    record = _records().get(_selection(config))
    if record:
        order = longest_first([item.nodeid for item in items], record)
        items[:] = [items[i] for i in order]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[_file_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not config.getoption("record_file_durations") or hasattr(config, "workerinput"):
        return  # an xdist worker: its reports reach the controller, which writes them
    records = _records()
    selection = _selection(config)
    measured = {name: round(seconds, 1) for name, seconds in _seconds.items()}
    records[selection] = dict(sorted({**records.get(selection, {}), **measured}.items()))
    RECORD.write_text(json.dumps(records, indent=1) + "\n")
