"""Shared test setup.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, i.e. before
a kernel module is imported: the interpreter runs the Triton kernels on CPU tensors.

The real-system tests need programs beyond Python (nginx, a C compiler, Prometheus). A
missing one is named before the run (report header) and every skipped test is
listed with its reason after it, so a whole suite never skips silently. With
``PREFIXSERVE_REQUIRE_SYSTEM_DEPS=1`` (``.ci/run`` sets it) a missing program
fails the run instead.
"""

import os
import shutil
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Serve's controller kills a proxy actor not ready within this many seconds (5 by default),
# and serve.start then fails. Two test workers on two cores can make a proxy's start take
# longer; Ray's processes inherit this from the test process that starts them.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
# Serve's routers skip a replica whose queue-length probe misses this deadline (0.1 s by
# default) and take the next tier. On two cores shared by two clusters a replica nothing
# has been sent to yet (so it is in no router's queue-length cache and is probed on every
# request) can miss it request after request, and tests that check where keys land see
# Serve's fallback rather than the router's choice. Serve's documented remedy for slow
# answers: a longer deadline (its backoff's ceiling is raised to it too). A probe of a dead
# replica fails at once, so only a stalled one waits this long.
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "5")
# The engines the tests build in-process spin as `prefixserve replica` does (router/cli's
# ENVIRONMENT_DEFAULTS): libgomp's default spin between OpenMP regions collapses when the other
# test worker wants the cores. Read when torch loads libgomp, so set before anything imports it.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from file_order import (  # noqa: E402, F401  (hooks: pytest reads them off this module)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_runtest_logreport,
    pytest_sessionfinish,
)
from nginx_helpers import find_nginx  # noqa: E402  (after the environment above)
from prometheus_helpers import find_prometheus  # noqa: E402

# program -> (found?, which tests need it)
_SYSTEM_DEPS = {
    "nginx": (
        find_nginx() is not None,
        "tests/router/nginx/test_nginx_parity.py, tests/router/nginx/test_nginx_e2e.py",
    ),
    "C compiler": (shutil.which(os.environ.get("CC", "cc")) is not None, "tests/kernels/test_cpu_kernels.py"),
    "prometheus": (
        find_prometheus() is not None,
        "tests/test_observability.py, tests/router/serve/test_cluster.py's dashboard test",
    ),
}


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A seed per test and parametrization (a crc32 of its node id): fresh data everywhere, reproducible."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """model_helpers.tiny_checkpoint, cached for the test process: ``tiny_ckpts(**builder_arguments)``
    builds that random-weight checkpoint directory the first time and returns the same one after.

    Nothing writes to a checkpoint once built, so every module and test may read it. Most tests
    take ``ckpt`` (the defaults); a module whose checks need another shape or other weights keeps
    a local fixture named for the difference (``ckpt_seed11``, ``ckpt_8192_positions``...) on this.
    """
    from model_helpers import tiny_checkpoint  # here, not above: torch only for the tests that need it

    built: dict[tuple[tuple[str, Any], ...], str] = {}

    def get(**kwargs: Any) -> str:
        key = tuple(sorted(kwargs.items()))
        if key not in built:
            built[key] = str(tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", **kwargs))
        return built[key]

    return get


@pytest.fixture(scope="session")
def ckpt(tiny_ckpts: Callable[..., str]) -> str:
    """The tiny random-weight checkpoint the tests share: model_helpers.tiny_checkpoint's defaults
    (Llama, hidden 64, 4 query / 2 KV heads, 2 layers, 1024 positions, seed 0), built once per process."""
    return tiny_ckpts()


@pytest.fixture(scope="session")
def ckpt_4096_positions(tiny_ckpts: Callable[..., str]) -> str:
    """The shared tiny shape with 4096 positions (``ckpt`` has 1024): for max_model_len 4096."""
    return tiny_ckpts(max_pos=4096)


@pytest.fixture(scope="session")
def gqa_ckpt(tiny_ckpts: Callable[..., str]) -> str:
    """The shared tiny shape with 8 query heads over its 2 KV heads (seed 3): the tensor-parallel
    tests' model, whose heads split over 2 ranks (and not over 3)."""
    return tiny_ckpts(heads=8, seed=3)


@pytest.fixture(scope="module")
def replica(request: pytest.FixtureRequest, ckpt: str) -> Iterator[Any]:
    """A replica (the real app and engine, server_helpers.InProcessReplica) on the shared checkpoint.

    One per test module, never shared across modules: its engine keeps state (cached blocks,
    metrics) that a module's tests may count on. A module sets InProcessReplica's keyword
    arguments in a module-level ``REPLICA_OPTIONS`` dict (max_model_len, api_keys, replica_name...).
    """
    from server_helpers import InProcessReplica

    r = InProcessReplica(ckpt, **getattr(request.module, "REPLICA_OPTIONS", {}))
    try:
        yield r
    finally:
        r.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = []
    for name, (found, tests) in _SYSTEM_DEPS.items():
        state = "found" if found else f"MISSING: {tests} will be skipped (scripts/system-deps.sh installs it)"
        lines.append(f"system dependency {name}: {state}")
    return lines


def pytest_sessionstart(session: pytest.Session) -> None:
    missing = [name for name, (found, _) in _SYSTEM_DEPS.items() if not found]
    if missing and os.environ.get("PREFIXSERVE_REQUIRE_SYSTEM_DEPS") == "1":
        raise pytest.UsageError(f"PREFIXSERVE_REQUIRE_SYSTEM_DEPS=1 but missing: {', '.join(missing)}")
    # The report header is hidden under -q (as make test runs): say what will skip anyway.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if missing and reporter is not None and session.config.get_verbosity() < 0:
        for line in pytest_report_header(session.config):
            if "MISSING" in line:
                reporter.write_line(line, yellow=True)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons: Counter[str] = Counter()
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    terminalreporter.section("skipped tests, by reason")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:4d} skipped: {reason}")
