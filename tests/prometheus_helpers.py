"""Run a real Prometheus for tests and evaluate the repository's dashboard against it.

The Prometheus (Debian's ``prometheus`` package, installed by scripts/system-deps.sh)
runs as our own child process on a free loopback port with its storage in a temp
dir, and is terminated and reaped on exit: a service the package may have set up
is never used. ``dashboard_queries`` reads observability/grafana-dashboard.json;
``check_plausible`` is what "a panel shows something sensible" means in tests.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from nginx_helpers import free_ports
from process_helpers import ManagedProcess

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "observability" / "grafana-dashboard.json"
# What the tests substitute for the dashboard's variables: every model, a window
# that spans a few seconds of load scraped every second.
VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}


def find_prometheus() -> str | None:
    return shutil.which("prometheus") or next(
        (p for p in ("/usr/bin/prometheus", "/usr/local/bin/prometheus") if os.access(p, os.X_OK)), None
    )


# Router series only the ``placed`` policy exports.
PLACED_SERIES = (
    "prefixserve_router_placed_branches",
    "prefixserve_router_predicted_cached_fraction",
    "prefixserve_router_reported_cached_fraction",
    "prefixserve_router_history_index_entries",
)

# Series only an engine with a KV tier (host or disk) exports.
TIER_SERIES = ("vllm:external_prefix_cache_", "prefixserve:kv_tier_", "prefixserve:kv_disk_", "prefixserve:kv_drain_")


@dataclass(frozen=True)
class Query:
    """One PromQL expression of the dashboard and the panel it belongs to."""

    panel: str
    unit: str
    expr: str

    @property
    def needs_router(self) -> bool:
        """True when only the Ray ingress exports its series (not a standalone replica)."""
        return "prefixserve_router_" in self.expr

    @property
    def needs_placed(self) -> bool:
        """True when only a ``placed`` router exports its series (conversation routing)."""
        return any(name in self.expr for name in PLACED_SERIES)

    @property
    def needs_flow(self) -> bool:
        """True when only an ingress with tenants (flow control) exports its series."""
        return "prefixserve_router_flow_" in self.expr

    @property
    def needs_tiers(self) -> bool:
        """True when only replicas with KV tiers (``kv_offloading_size``, ``kv_disk_path``) export its series."""
        return any(name in self.expr for name in TIER_SERIES)


def dashboard_queries(path: Path = DASHBOARD) -> list[Query]:
    """Every target expression of the dashboard, its variables substituted (VARIABLES)."""
    dashboard = json.loads(path.read_text())
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"unsubstituted variable in {expr!r}"
            queries.append(Query(panel["title"], panel["fieldConfig"]["defaults"].get("unit", ""), expr))
    return queries


def check_plausible(query: Query, values: Sequence[float]) -> str | None:
    """Why ``values`` are not what ``query``'s panel should show, or None when they are.

    Every panel plots rates, counts, fractions or durations: finite and >= 0; fractions
    (unit percentunit) at most 1; hit rates above 0 after repeated prefixes; latency
    quantiles above 0.
    """
    if not values:
        return "no series"
    if any(not math.isfinite(v) or v < 0 for v in values):
        return f"values not finite and >= 0: {values}"
    if query.unit == "percentunit" and max(values) > 1:
        return f"a fraction above 1: {values}"
    if "prefix_cache_hits" in query.expr and max(values) <= 0:
        return f"no prefix-cache hits: {values}"
    if "histogram_quantile" in query.expr and min(values) <= 0:
        return f"a latency quantile of 0: {values}"
    return None


class PrometheusProcess(ManagedProcess):
    """A real Prometheus scraping ``targets`` (host:port) every ``scrape_interval_s``, on a free loopback port.

    Prometheus caps a scrape's timeout at its interval; a target whose /metrics
    fans out (the Ray ingress asks every ingress and engine replica) needs an
    interval longer than that fan-out takes on a loaded 2-core CI machine.
    """

    name = "prometheus"

    def __init__(
        self, targets: Sequence[str], workdir: Path, metrics_path: str = "/metrics", scrape_interval_s: int = 1
    ) -> None:
        binary = find_prometheus()
        assert binary is not None, "prometheus is not installed (scripts/system-deps.sh installs it)"
        self.port = free_ports(1)[0]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(
                {  # YAML is a superset of JSON
                    "global": {
                        "scrape_interval": f"{scrape_interval_s}s",
                        "scrape_timeout": f"{scrape_interval_s}s",
                        "evaluation_interval": "1s",
                    },
                    "scrape_configs": [
                        {
                            "job_name": "prefixserve",
                            "metrics_path": metrics_path,
                            "static_configs": [{"targets": list(targets)}],
                        }
                    ],
                }
            )
        )
        super().__init__(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            log_path=workdir / "prometheus.log",
            ready_url=f"{self.base_url}/-/ready",
            startup_timeout_s=60.0,
            cwd=workdir,
        )

    def query(self, expr: str) -> list[float]:
        """The values of an instant query's result (one per series); raises on a PromQL error."""
        response = httpx.get(f"{self.base_url}/api/v1/query", params={"query": expr}, timeout=10.0)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"prometheus refused {expr!r}: {body.get('error', response.text)}")
        result = body["data"]["result"]
        if body["data"]["resultType"] == "scalar":
            return [float(result[1])]
        return [float(series["value"][1]) for series in result]

    def targets_up(self) -> bool:
        """Whether every scrape target answered its last scrape."""
        active = httpx.get(f"{self.base_url}/api/v1/targets", timeout=10.0).json()["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)

    def wait_until(self, predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
        """Poll ``predicate`` until true; a bounded wait for scrapes, not a timing assertion."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} within {timeout_s} s\n{self.log_tail()}")
            time.sleep(0.5)

    def scrape_errors(self) -> list[str]:
        """Each target's last scrape error, if any (for failure messages)."""
        active = httpx.get(f"{self.base_url}/api/v1/targets", timeout=10.0).json()["data"]["activeTargets"]
        return [f"{t['scrapeUrl']}: {t['lastError']}" for t in active if t.get("lastError")]

    def evaluate(self, queries: Sequence[Query], timeout_s: float = 60.0) -> None:
        """Poll until each query has returned plausible values (check_plausible); fail naming those that have not.

        A query is done once it has answered plausibly: a panel plots a time series, and
        a rate over a window that has slid past the load rightly goes empty again, so
        the queries need not all be plausible at the same instant.
        """
        pending = {f"{q.panel}: {q.expr}": q for q in queries}
        problems: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            for name, q in list(pending.items()):
                why = check_plausible(q, self.query(q.expr))
                if why is None:
                    del pending[name]
                    problems.pop(name, None)
                else:
                    problems[name] = why
            if not pending:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    "dashboard queries without plausible values:\n"
                    + "\n".join(f"  {k}\n    -> {v}" for k, v in problems.items())
                    + f"\nlast scrape errors: {self.scrape_errors() or 'none'}"
                )
            time.sleep(1.0)
