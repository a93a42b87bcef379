"""The benchmark harness: percentiles, the SSE reader, the JSON and PNG writers."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prefixserve.common.config_util import from_cli_args
from prefixserve.loadtest.harness import report, server, sse, stats
from prefixserve.loadtest.harness.cli import add_flags, flag_field
from prefixserve.loadtest.harness.plotting import figure


def test_nearest_rank_and_summary() -> None:
    assert stats.nearest_rank([], 50) is None
    assert stats.nearest_rank([3.0, 1.0, 2.0], 50) == 2.0
    assert stats.summary_ms([]) == {"mean": None, "p50": None, "p99": None}
    assert stats.summary_ms([0.001, 0.003]) == pytest.approx({"mean": 2.0, "p50": 2.0, "p99": 2.98})
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


LINES = ["", ": keep-alive", 'data: {"choices": [{"delta": {"content": "a"}}]}', "data: [DONE]", "data: {bad"]


def test_sse_events_stop_at_done() -> None:
    assert list(sse.iter_events([line.encode() for line in LINES])) == [{"choices": [{"delta": {"content": "a"}}]}]

    async def lines():
        for line in LINES:
            yield line

    async def collect():
        return [e async for e in sse.aiter_events(lines())]

    assert asyncio.run(collect()) == [{"choices": [{"delta": {"content": "a"}}]}]
    with pytest.raises(json.JSONDecodeError):
        list(sse.iter_events(["data: {bad"]))


def test_starts_output() -> None:
    assert sse.starts_output({"choices": [{"delta": {"content": "x"}}]})
    assert sse.starts_output({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    assert not sse.starts_output({"choices": [{"delta": {"role": "assistant"}}]})
    assert not sse.starts_output({"usage": {}})


def test_report_writers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.fmt(None, ".2f") == "n/a" and report.fmt(1.234, ".2f") == "1.23"
    assert report.config_json(argparse.Namespace(out=Path("a/b"), n=1)) == {"out": "a/b", "n": 1}
    out = report.write_json(tmp_path / "sub" / "r.json", {"x": 1}, newline=True)
    assert out.read_text() == '{\n  "x": 1\n}\n'
    assert capsys.readouterr().out == f"\nwrote {out}\n"
    png = tmp_path / "p" / "f.png"
    with figure(png, 50, figsize=(2, 2)) as (_, ax):
        ax.plot([0, 1], [0, 1])
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("q", [0, 5, 50, 95, 100])
def test_percentile_agrees_with_numpy(q: float) -> None:
    xs = [random.Random(q).expovariate(1.0) for _ in range(37)]
    assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert stats.percentile([], q) is None


def test_server_start_wait_stop(tmp_path: Path) -> None:
    port = server.free_port()
    command = [sys.executable, "-m", "http.server", str(port), "--bind", server.HOST, "--directory", str(tmp_path)]
    url = f"http://{server.HOST}:{port}/"
    with server.running_server(command, server.server_env(), url, tmp_path / "logs" / "server.log", 30.0) as proc:
        assert proc.poll() is None
    assert proc.poll() is not None
    dead = server.start_server([sys.executable, "-c", "pass"], tmp_path / "dead.log", server.server_env())
    with pytest.raises(RuntimeError, match="exited with 0"):
        server.wait_until_answers(dead, f"http://{server.HOST}:{port}/", 30.0, tmp_path / "dead.log")


def test_markdown_table() -> None:
    table = report.markdown_table(["a", "b", "c"], [[1, "x", 2.5], ("y", None, "")], "lr")
    assert table == "| a | b | c |\n|---|---:|---|\n| 1 | x | 2.5 |\n| y | None |  |"
    assert report.markdown_table("a | b | c", [[1, "x", 2.5], ("y", None, "")], "lr") == table


def test_floor_rank_takes_the_sample_at_floor_q_n() -> None:
    xs = [float(i) for i in range(10, 0, -1)]
    assert stats.floor_rank([], 99) is None
    assert stats.floor_rank(xs, 99) == 10.0 and stats.floor_rank(xs, 50) == 6.0 and stats.floor_rank(xs, 100) == 10.0
    for n in range(1, 40):
        ys = list(range(n))
        assert stats.floor_rank(ys, 99) == ys[min(n - 1, int(0.99 * n))]


def test_median_run_is_the_run_at_the_median_rate() -> None:
    runs = [{"requests_per_s": r, "id": i} for i, r in enumerate([3.0, 1.0, 2.0, 4.0])]
    assert stats.median_run(runs)["id"] == 0 and stats.median_run(runs[:3])["id"] == 2


def test_median_difference_tells_apart_what_differs_and_not_what_does_not() -> None:
    far = stats.median_difference([1.0, 1.1, 0.9, 1.05, 0.95], [2.0, 2.1, 1.9, 2.05, 1.95])
    assert far.difference == pytest.approx(-1.0) and far.high < 0 and far.a_lower_share == 1.0
    assert far.low <= far.difference <= far.high
    # The same spread-out runs in another order: no difference, an interval either side of 0, pairs even.
    runs = list(np.random.default_rng(3).normal(0.6, 0.1, 16))
    same = stats.median_difference(runs, runs[::-1])
    assert same.difference == 0.0 and same.low < 0 < same.high and same.a_lower_share == 0.5
    # Ties count half; the interval of constant samples is the difference itself; the seed fixes it.
    tied = stats.median_difference([1.0, 1.0], [1.0, 1.0])
    assert (tied.difference, tied.low, tied.high, tied.a_lower_share) == (0.0, 0.0, 0.0, 0.5)
    xs, ys = [0.5, 0.7, 0.6, 0.9], [0.4, 0.8, 0.55]
    assert stats.median_difference(xs, ys) == stats.median_difference(xs, ys)
    assert stats.median_difference(xs, ys, confidence=0.5).high <= stats.median_difference(xs, ys).high
    with pytest.raises(ValueError, match="at least one"):
        stats.median_difference([], [1.0])
    with pytest.raises(ValueError, match="confidence"):
        stats.median_difference([1.0], [1.0], confidence=1.0)


@dataclasses.dataclass(frozen=True)
class _Options:
    count: int = flag_field(3, "how many", flag="--n")
    mode: str = flag_field("a", choices=("a", "b"))
    fixed: float = 1.5


def test_flag_fields_become_flags_and_only_they() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, _Options, "options")
    args = parser.parse_args(["--n", "5", "--mode", "b"])
    assert from_cli_args(_Options, args) == _Options(count=5, mode="b")
    assert "--fixed" not in parser.format_help() and "how many" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])


_RUN_UNTIL_TERMINATED = """
import argparse, contextlib, sys, time
from pathlib import Path
from prefixserve.loadtest.harness.cli import plan_and_run

@contextlib.contextmanager
def server(marker):
    try:
        yield
    finally:
        Path(marker).write_text("stopped")

def run(args, plan):
    with server(args.marker):
        print("running", flush=True)
        time.sleep(60)
    return 0

parser = argparse.ArgumentParser()
parser.add_argument("--marker")
parser.add_argument("--verbose", action="store_true")
sys.exit(plan_and_run(parser, lambda args: None, run))
"""


def test_sigterm_unwinds_the_run_so_what_it_started_is_stopped(tmp_path):
    marker = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_UNTIL_TERMINATED, "--marker", str(marker)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "running"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert marker.read_text() == "stopped"


_RUN_WITH_A_SLOW_CLEANUP = """
import argparse, contextlib, sys, time
from pathlib import Path
from prefixserve.loadtest.harness.cli import plan_and_run

@contextlib.contextmanager
def server(marker, release):
    try:
        yield
    finally:
        print("stopping", flush=True)
        while not Path(release).exists():  # held by the test
            time.sleep(0.01)
        Path(marker).write_text("stopped")

def run(args, plan):
    with server(args.marker, args.release):
        print("running", flush=True)
        time.sleep(60)
    return 0

parser = argparse.ArgumentParser()
parser.add_argument("--marker")
parser.add_argument("--release")
parser.add_argument("--verbose", action="store_true")
sys.exit(plan_and_run(parser, lambda args: None, run))
"""


def test_a_second_sigterm_does_not_cut_the_cleanup_short(tmp_path):
    marker, release = tmp_path / "stopped", tmp_path / "release"
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN_WITH_A_SLOW_CLEANUP, "--marker", str(marker), "--release", str(release)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "running"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "stopping"
        # While it stops what it started, SIGTERM is ignored (the kernel drops a second one at once).
        status = Path(f"/proc/{proc.pid}/status").read_text()
        ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGTERM - 1))
        proc.send_signal(signal.SIGTERM)
        release.touch()
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert marker.read_text() == "stopped"


def test_core_sets_split_the_cores_a_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    assert server.core_sets(2) == [(0, 1), (2, 3)]
    assert server.core_sets(5) == [(0,), (1,), (2,), (3,), (5,)]
    assert server.core_sets(6) is None


def test_a_server_started_on_cores_runs_on_those_cores(tmp_path: Path) -> None:
    core = min(server.os.sched_getaffinity(0))
    proc = server.start_server(
        [sys.executable, "-c", "import os, sys; sys.stdout.write(repr(sorted(os.sched_getaffinity(0))))"],
        tmp_path / "pinned.log",
        server.server_env(),
        cores=[core],
    )
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "pinned.log").read_text() == repr([core])
