"""The order test files run in: unrecorded first, then the longest recorded, each file's tests together."""

from __future__ import annotations

import json

import file_order


def test_files_run_longest_first_with_unrecorded_ones_before_them_and_each_file_whole() -> None:
    nodeids = [
        "tests/a.py::one",
        "tests/b.py::one",
        "tests/a.py::two",
        "tests/new.py::one",
        "tests/c.py::one",
        "tests/b.py::two",
    ]
    order = file_order.longest_first(nodeids, {"tests/a.py": 1.0, "tests/b.py": 30.0, "tests/c.py": 5.0})
    assert [nodeids[i] for i in order] == [
        "tests/new.py::one",
        "tests/b.py::one",
        "tests/b.py::two",
        "tests/c.py::one",
        "tests/a.py::one",
        "tests/a.py::two",
    ]
    assert file_order.longest_first(nodeids, {}) == [0, 2, 1, 5, 3, 4]  # no record: files as first collected


def test_the_shipped_record_names_test_files_of_this_checkout_per_selection() -> None:
    records = json.loads(file_order.RECORD.read_text())
    assert set(records) == {"not slow", "slow"}
    root = file_order.RECORD.parent.parent
    for files in records.values():
        assert files and all(seconds >= 0 for seconds in files.values())
        missing = [name for name in files if not (root / name).is_file()]
        assert not missing, (
            f"recorded files that are gone (drop them, or rerun with --record-file-durations): {missing}"
        )
