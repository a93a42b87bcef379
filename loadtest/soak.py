"""``python -m prefixserve.loadtest.soak``: a replica (or the local cluster) under a steady mixed load for a set time.

Job: show that the server holds up over a long run with hostile clients among
the normal ones. It starts a real server with the default SmolLM2 model on
loopback: a standalone ``prefixserve replica`` (the nginx path), or with
``--cluster`` the local Ray cluster as ``prefixserve up`` runs it
(loadtest/cluster_run.py's LocalServeCluster, two engine replicas behind the
ingress). Then ``--concurrency`` closed-loop clients each pick, per action, a
normal chat (streamed, shared system prompts from loadtest/workloads.py's
shared_prefix) or, with probability ``--hostile-share``, one hostile action:

* ``cancel``: a stream closed after a few events;
* ``too_long``: a prompt longer than the model's context; ``huge_messages``: a
  list of ``--huge-messages`` empty system messages and one question;
  ``bad_params``: each of a set of invalid sampling parameters in turn;
  ``bad_key``: a wrong API key;
* ``big_header``: a 1 MiB header; ``many_headers``: 10,000 headers (no API key:
  the limits come first);
* ``unread_stream``: a stream whose body is not read for ``--hold-s``;
  ``slow_headers``: headers announcing a body that never comes, held for
  ``--hold-s``; ``slow_body``: a body sent one byte at a time;
* ``dup_ids``: four concurrent requests with one ``X-Request-Id``;
* ``big_tools``: 1,000 tools of 60 properties (3.3 MB; over the tools cap: 400, refused before
  any schema is checked or rendered); ``slow_schema``: a JSON schema whose pattern repeats a
  character 30,000 times (xgrammar's compile time grows with its square: 400 naming the bound,
  before any compile), a new schema each time.

``--kinds`` limits the draw to some of these (to find which one a symptom
follows); the others keep their relative weights.

Every action is bounded in time (``--hold-s``, and a client timeout) and goes to
127.0.0.1 only; the run stops by itself. Time is cut into buckets
(``--bucket-s``, a minute by default): each ends with an idle pause in which
nothing is sent and /metrics is polled until ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` are 0, then ``vllm:kv_cache_usage_perc`` is read.
Per bucket it reports requests by kind and status, TTFT p50/p99 of the normal
chats, the RSS of every server process (psutil: the replica and its children,
or every process this one started for the cluster), open file descriptors and
threads. A few unrecorded chats warm the server up before the first phase.
``--compare-baseline`` first runs a phase with no hostile share
(``--baseline-s``) on the same server, so the TTFT p99 ratio comes from one
invocation. It then evaluates the targets and prints PASS/FAIL for each:

* no 5xx answer, in any phase, to any request;
* RSS after warm-up (``--warmup-s``): every idle sample within 2% of the first
  one, and no upward trend (least-squares slope of all samples after warm-up,
  times that span, within 2% of their mean);
* TTFT p99 of the normal chats within 1.5x the baseline phase's (after warm-up);
* KV usage, running and waiting back to 0 at every idle pause.

Writes ``soak.json`` (everything), ``soak.md`` (the tables) and ``soak.png``
(RSS and TTFT p99 over time) into ``--out-dir``. A status the server should not
give (a 429 because slow clients hold slots, a 200 to a 1 MiB header) is
counted as it came: the table says what the server did. Exit status: 0 when
every evaluated target passed, 1 otherwise.

Imports httpx, psutil, prometheus_client, matplotlib (for the PNG), tqdm, and
loadtest/cluster_run.py (Ray only with ``--cluster``); never torch.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from prefixserve.common.config_util import from_cli_args
from prefixserve.loadtest.cluster_run import LocalServeCluster
from prefixserve.loadtest.harness import server as child
from prefixserve.loadtest.harness.cli import add_flags, flag_field
from prefixserve.loadtest.harness.client import stream_one
from prefixserve.loadtest.harness.plotting import figure
from prefixserve.loadtest.harness.report import markdown_table, write_json
from prefixserve.loadtest.harness.server import HOST
from prefixserve.loadtest.harness.stats import nearest_rank
from prefixserve.loadtest.workloads import DEFAULT_MODEL, SharedPrefixConfig, shared_prefix

API_KEY = "soak-key"
HOSTILE_KINDS: dict[str, float] = {  # kind -> relative weight within the hostile share
    "cancel": 3.0,
    "too_long": 1.0,
    "huge_messages": 0.5,
    "bad_params": 2.0,
    "bad_key": 2.0,
    "big_header": 1.0,
    "many_headers": 1.0,
    "unread_stream": 1.0,
    "slow_headers": 1.0,
    "slow_body": 1.0,
    "dup_ids": 1.0,
    "big_tools": 0.5,
    "slow_schema": 1.0,
}
# big_tools' body: 1,000 tools of 60 properties each (3.3 MB, the probe's), over any tool cap.
BIG_TOOLS = 1000
BIG_TOOL_PROPERTIES = 60
# slow_schema's pattern: a repeat whose compile time grows with its square (xgrammar's), past any bound.
SLOW_PATTERN = "^a{30000}$"
NORMAL = "chat"
BAD_PARAMS: tuple[dict[str, Any], ...] = (
    {"temperature": -1.0},
    {"top_p": 2.0},
    {"max_tokens": -5},
    {"n": 0},
    {"top_k": -7},
    {"stream_options": {"include_usage": True}},
    {"logit_bias": {"not-a-token": 3}},
    {"frequency_penalty": 9.0},
    {"unknown_field": 1},
    {"seed": "x"},
)
METRICS = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
RSS_TOLERANCE = 0.02
TTFT_RATIO = 1.5


@dataclass(frozen=True)
class SoakConfig:
    """One soak run's settings (the CLI's flags); see the module docstring."""

    duration_s: float = flag_field(1800.0, "length of the soak phase")
    cluster: bool = flag_field(
        False, "soak the local Ray cluster (prefixserve up's shape) instead of one standalone replica"
    )
    replicas: int = flag_field(2, "engine replicas with --cluster")
    hostile_share: float = flag_field(0.3, "probability that a client's next action is a hostile one")
    compare_baseline: bool = flag_field(False, "first run a phase without the hostile share, for the TTFT p99 ratio")
    baseline_s: float = flag_field(300.0, "length of that phase")
    bucket_s: float = flag_field(60.0, "report bucket")
    warmup_s: float = flag_field(60.0, "start of the soak phase left out of the RSS and TTFT targets")
    idle_timeout_s: float = flag_field(20.0, "longest wait, at each idle pause, for running and waiting to reach 0")
    concurrency: int = flag_field(2, "closed-loop clients")
    max_in_flight: int = flag_field(4, "the standalone replica's --max-in-flight")
    model: str = flag_field(DEFAULT_MODEL, "the model")
    max_tokens: int = flag_field(16, "tokens per normal chat")
    hold_s: float = flag_field(5.0, "how long a slow or non-reading client holds its connection")
    client_timeout_s: float = 120.0
    huge_messages: int = flag_field(20_000, "empty system messages in a huge_messages request")
    sample_s: float = 5.0
    seed: int = flag_field(0, "the traffic's seed")
    # The hostile kinds drawn from (with HOSTILE_KINDS' weights); all of them by default.
    kinds: tuple[str, ...] = tuple(HOSTILE_KINDS)

    def __post_init__(self) -> None:
        for name in (
            "duration_s",
            "bucket_s",
            "concurrency",
            "max_tokens",
            "hold_s",
            "sample_s",
            "client_timeout_s",
            "idle_timeout_s",
            "max_in_flight",
            "replicas",
            "huge_messages",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.hostile_share <= 1.0:
            raise ValueError(f"hostile_share must be in [0, 1], got {self.hostile_share!r}")
        if self.warmup_s < 0 or self.baseline_s <= 0:
            raise ValueError("warmup_s must be >= 0 and baseline_s > 0")
        if self.bucket_s > self.duration_s:
            raise ValueError(f"bucket_s ({self.bucket_s}) must not exceed duration_s ({self.duration_s})")
        unknown = [k for k in self.kinds if k not in HOSTILE_KINDS]
        if unknown or not self.kinds or len(set(self.kinds)) != len(self.kinds):
            raise ValueError(
                f"kinds must be distinct names among {', '.join(HOSTILE_KINDS)}; got {', '.join(self.kinds) or 'none'}"
            )


# ------------------------------------------------------------------------------ the server


class StandaloneServer:
    """``prefixserve replica`` in its own session on a free loopback port; its processes for RSS."""

    def __init__(self, config: SoakConfig, log_path: Path) -> None:
        self.config = config
        self.port = child.free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 600.0) -> None:
        command = [
            sys.executable,
            "-m",
            "prefixserve.router.cli",
            "replica",
            "--model",
            self.config.model,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--api-key",
            API_KEY,
            "--max-in-flight",
            str(self.config.max_in_flight),
            "--log-level",
            "warning",
        ]
        self.proc = child.start_server(command, self.log_path, child.server_env())
        try:
            child.wait_until_answers(self.proc, f"{self.base_url}/health", timeout_s, self.log_path)
        except RuntimeError:
            self.stop()
            raise

    def processes(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        if self.proc is not None:
            child.stop_server(self.proc, grace_s=30)


class ClusterServer:
    """The local Ray cluster with the prefixserve app (``prefixserve up``'s shape), on a free loopback port."""

    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.port = child.free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.cluster: LocalServeCluster | None = None

    def start(self, timeout_s: float = 900.0) -> None:
        from prefixserve.loadtest.bench_cluster import app_args
        from prefixserve.router.policies import DEFAULT_POLICY

        app = app_args(
            DEFAULT_POLICY,
            model=self.config.model,
            replicas=self.config.replicas,
            sizing=None,
            seed=self.config.seed,
            epsilon=None,
        )
        app["ingress"]["api_keys"] = [API_KEY]
        self.cluster = LocalServeCluster(num_cpus=self.config.replicas + 1, port=self.port, host=HOST)
        self.cluster.deploy(app, "soak", num_replicas=self.config.replicas, timeout_s=timeout_s, api_key=API_KEY)

    def processes(self) -> list[psutil.Process]:
        # Ray's GCS, raylet, Serve's controller, proxy and replicas: all started by this process.
        return psutil.Process().children(recursive=True)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


@dataclass
class ProcessSample:
    """The server's processes at one moment: RSS per process (``name[pid]``), and totals."""

    t_s: float
    rss_bytes: dict[str, int]
    fds: int
    threads: int

    @property
    def rss_total(self) -> int:
        return sum(self.rss_bytes.values())


def sample_processes(processes: Sequence[psutil.Process], t_s: float) -> ProcessSample:
    """RSS, open file descriptors and threads of ``processes`` (those gone meanwhile are left out)."""
    rss: dict[str, int] = {}
    fds = threads = 0
    for p in processes:
        try:
            with p.oneshot():
                rss[f"{p.name()}[{p.pid}]"] = p.memory_info().rss
                fds += p.num_fds()
                threads += p.num_threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ProcessSample(t_s, rss, fds, threads)


def scrape_gauges(text: str) -> dict[str, float]:
    """``METRICS`` from a /metrics text: running and waiting summed over replicas, KV usage their maximum."""
    out = dict.fromkeys(METRICS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                if sample.name == METRICS[0]:
                    out[sample.name] = max(out[sample.name], sample.value)
                else:
                    out[sample.name] += sample.value
    return out


# ------------------------------------------------------------------------------ the traffic


@dataclass
class Bucket:
    """One bucket of a phase: what was sent and answered, and the server's state at its idle pause."""

    index: int
    start_s: float
    end_s: float = 0.0
    statuses: dict[str, Counter[str]] = field(default_factory=dict)  # kind -> status -> count
    ttfts_s: list[float] = field(default_factory=list)  # the normal chats answered 200
    idle: dict[str, float] = field(default_factory=dict)  # METRICS at the idle pause
    idle_wait_s: float = 0.0
    sample: ProcessSample | None = None

    def count(self, kind: str, status: int | str) -> None:
        self.statuses.setdefault(kind, Counter())[str(status)] += 1

    def summary(self) -> dict[str, Any]:
        totals: Counter[str] = Counter()
        for counts in self.statuses.values():
            totals.update(counts)
        return {
            "index": self.index,
            "start_s": round(self.start_s, 2),
            "end_s": round(self.end_s, 2),
            "statuses": {k: dict(sorted(v.items())) for k, v in sorted(self.statuses.items())},
            "status_totals": dict(sorted(totals.items())),
            "normal_ok": len(self.ttfts_s),
            "ttft_p50_s": nearest_rank(self.ttfts_s, 50),
            "ttft_p99_s": nearest_rank(self.ttfts_s, 99),
            "idle": self.idle,
            "idle_wait_s": round(self.idle_wait_s, 2),
            "rss_total_bytes": self.sample.rss_total if self.sample else None,
            "rss_bytes": self.sample.rss_bytes if self.sample else {},
            "fds": self.sample.fds if self.sample else None,
            "threads": self.sample.threads if self.sample else None,
        }


def _status_line(raw: bytes) -> int | str:
    """The status code of an HTTP status line, or what came instead."""
    if not raw:
        return "closed"
    parts = raw.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else "garbled"


class Traffic:
    """The clients: normal chats and each hostile action, every one bounded in time."""

    def __init__(self, config: SoakConfig, base_url: str, port: int) -> None:
        self.config = config
        self.base_url = base_url
        self.port = port
        self.chat_url = f"{base_url}/v1/chat/completions"
        self.auth = {"Authorization": f"Bearer {API_KEY}"}
        spec = SharedPrefixConfig(
            num_groups=4,
            prompts_per_group=32,
            system_prompt_len=192,
            question_len=24,
            output_len=config.max_tokens,
            seed=config.seed,
            model=config.model,
        )
        self.bodies = [r.body for r in shared_prefix(spec)]
        self._next_body = 0
        self._next_bad = 0
        self._ids = 0
        self.t0 = time.perf_counter()
        self.client: httpx.AsyncClient | None = None

    def body(self) -> dict[str, Any]:
        body = self.bodies[self._next_body % len(self.bodies)]
        self._next_body += 1
        return body

    async def __aenter__(self) -> Traffic:
        limits = httpx.Limits(max_connections=4 * self.config.concurrency + 8)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.client_timeout_s, connect=30.0), limits=limits
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def warm_up(self) -> None:
        """A few chats (twice as many as system prompts), not recorded, so that the first phase does not start cold."""
        scratch = Bucket(-1, 0.0)
        for _ in range(2 * len({json.dumps(b["messages"][0]) for b in self.bodies})):
            await self.chat(scratch)

    # -- actions: each records into ``bucket`` ---------------------------------------------------
    async def chat(self, bucket: Bucket) -> None:
        assert self.client is not None
        record = await stream_one(self.client, self.chat_url, 0, self.body(), self.auth, self.t0)
        bucket.count(NORMAL, record.status if record.status is not None else "client_error")
        if record.ok and record.ttft_s is not None:
            bucket.ttfts_s.append(record.ttft_s)

    async def _post(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> int | str:
        assert self.client is not None
        try:
            response = await self.client.post(self.chat_url, json=body, headers=headers or self.auth)
            return response.status_code
        except httpx.HTTPError as exc:
            return f"client_{type(exc).__name__}"

    async def cancel(self, bucket: Bucket, rng: random.Random) -> None:
        assert self.client is not None
        body = {**self.body(), "stream": True, "max_tokens": 64}
        try:
            async with self.client.stream("POST", self.chat_url, json=body, headers=self.auth) as response:
                bucket.count("cancel", response.status_code)
                lines = rng.randint(0, 4)
                async for _ in response.aiter_lines():
                    lines -= 1
                    if lines < 0:
                        break  # leaving the block closes the connection mid-stream
        except httpx.HTTPError as exc:
            bucket.count("cancel", f"client_{type(exc).__name__}")

    async def too_long(self, bucket: Bucket) -> None:
        body = {**self.body(), "stream": False, "messages": [{"role": "user", "content": "lorem " * 40_000}]}
        bucket.count("too_long", await self._post(body))

    async def huge_messages(self, bucket: Bucket) -> None:
        messages = [{"role": "system", "content": ""}] * self.config.huge_messages
        self._ids += 1
        body = {
            **self.body(),
            "stream": False,
            "messages": [*messages, {"role": "user", "content": f"question {self._ids}"}],
        }
        bucket.count("huge_messages", await self._post(body))

    async def bad_params(self, bucket: Bucket) -> None:
        change = BAD_PARAMS[self._next_bad % len(BAD_PARAMS)]
        self._next_bad += 1
        bucket.count("bad_params", await self._post({**self.body(), "stream": False, **change}))

    async def bad_key(self, bucket: Bucket) -> None:
        status = await self._post({**self.body(), "stream": False}, {"Authorization": "Bearer not-the-key"})
        bucket.count("bad_key", status)

    async def big_tools(self, bucket: Bucket) -> None:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": "a tool of many parameters",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            f"p{j}": {"type": "string", "description": "a param"} for j in range(BIG_TOOL_PROPERTIES)
                        },
                    },
                },
            }
            for i in range(BIG_TOOLS)
        ]
        bucket.count("big_tools", await self._post({**self.body(), "stream": False, "tools": tools}))

    async def slow_schema(self, bucket: Bucket) -> None:
        self._ids += 1  # a new schema each time: no compiled grammar to reuse
        schema = {"type": "object", "properties": {f"k{self._ids}": {"type": "string", "pattern": SLOW_PATTERN}}}
        body = {
            **self.body(),
            "stream": False,
            "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}},
        }
        bucket.count("slow_schema", await self._post(body))

    async def _raw(
        self, head: bytes, body: bytes = b"", *, byte_delay_s: float = 0.0, answer_timeout_s: float
    ) -> int | str:
        """One raw HTTP/1.1 exchange: ``head``, then ``body`` (a byte at a time with a delay); the status."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, self.port), 30.0)
        except (TimeoutError, OSError) as exc:
            return f"client_{type(exc).__name__}"
        try:
            writer.write(head)
            await writer.drain()
            if byte_delay_s > 0:
                for i in range(len(body)):
                    writer.write(body[i : i + 1])
                    await writer.drain()
                    await asyncio.sleep(byte_delay_s)
            elif body:
                writer.write(body)
                await writer.drain()
            return _status_line(await asyncio.wait_for(reader.readline(), answer_timeout_s))
        except TimeoutError:
            return "no_answer"
        except (ConnectionError, OSError):
            return "reset"
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    def _head(
        self, method: str, path: str, extra: Sequence[str] = (), length: int | None = None, auth: bool = True
    ) -> bytes:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}:{self.port}", "Connection: close", *extra]
        if auth:
            lines.append(f"Authorization: Bearer {API_KEY}")
        if length is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {length}"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def big_header(self, bucket: Bucket) -> None:
        head = self._head("GET", "/v1/models", [f"X-Junk: {'a' * (1 << 20)}"], auth=False)
        bucket.count("big_header", await self._raw(head, answer_timeout_s=self.config.hold_s * 4))

    async def many_headers(self, bucket: Bucket) -> None:
        head = self._head("GET", "/v1/models", [f"X-H-{i}: v" for i in range(10_000)], auth=False)
        bucket.count("many_headers", await self._raw(head, answer_timeout_s=self.config.hold_s * 4))

    async def slow_headers(self, bucket: Bucket) -> None:
        # The body is announced and never sent; the server may answer (408) or keep waiting.
        head = self._head("POST", "/v1/chat/completions", length=200)
        bucket.count("slow_headers", await self._raw(head, answer_timeout_s=self.config.hold_s))

    async def slow_body(self, bucket: Bucket) -> None:
        body = json.dumps(
            {"model": self.config.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        head = self._head("POST", "/v1/chat/completions", length=len(body))
        status = await self._raw(
            head, body, byte_delay_s=self.config.hold_s / len(body), answer_timeout_s=self.config.client_timeout_s
        )
        bucket.count("slow_body", status)

    async def unread_stream(self, bucket: Bucket) -> None:
        assert self.client is not None
        body = {**self.body(), "stream": True, "max_tokens": 64}
        try:
            async with self.client.stream("POST", self.chat_url, json=body, headers=self.auth) as response:
                bucket.count("unread_stream", response.status_code)
                await asyncio.sleep(self.config.hold_s)  # the body stays unread, then the connection closes
        except httpx.HTTPError as exc:
            bucket.count("unread_stream", f"client_{type(exc).__name__}")

    async def dup_ids(self, bucket: Bucket) -> None:
        self._ids += 1
        headers = {**self.auth, "X-Request-Id": f"soak-dup-{self._ids}"}
        body = {**self.body(), "stream": False, "max_tokens": 4}
        for status in await asyncio.gather(*(self._post(body, headers) for _ in range(4))):
            bucket.count("dup_ids", status)

    async def act(self, kind: str, bucket: Bucket, rng: random.Random) -> None:
        """Run one action of ``kind``; one that overruns the client timeout is counted as such."""
        action: Callable[..., Any] = getattr(self, kind)
        call = action(bucket, rng) if kind == "cancel" else action(bucket)
        try:
            await asyncio.wait_for(call, self.config.client_timeout_s + self.config.hold_s * 4)
        except TimeoutError:
            bucket.count(kind, "client_timeout")


async def _idle_probe(traffic: Traffic, bucket: Bucket, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until nothing runs or waits; record the gauges then."""
    assert traffic.client is not None
    start = time.monotonic()
    while True:
        try:
            response = await traffic.client.get(f"{traffic.base_url}/metrics", headers=traffic.auth)
            gauges = scrape_gauges(response.text)
        except httpx.HTTPError:
            gauges = {}
        if gauges:
            bucket.idle = gauges
        settled = gauges and not gauges[METRICS[1]] and not gauges[METRICS[2]] and not gauges[METRICS[0]]
        if settled or time.monotonic() - start > timeout_s:
            bucket.idle_wait_s = time.monotonic() - start
            return
        await asyncio.sleep(0.5)


async def run_phase(
    config: SoakConfig,
    traffic: Traffic,
    server: StandaloneServer | ClusterServer,
    *,
    name: str,
    duration_s: float,
    hostile_share: float,
    samples: list[ProcessSample],
    bar: tqdm,
) -> list[Bucket]:
    """One phase: buckets of traffic, each closed by an idle pause; RSS sampled every ``sample_s``."""
    rng = random.Random(f"{config.seed}-{name}")
    kinds = list(config.kinds)
    weights = [HOSTILE_KINDS[k] for k in kinds]
    buckets: list[Bucket] = []
    n_buckets = max(1, round(duration_s / config.bucket_s))
    for b in range(n_buckets):
        bucket = Bucket(b, time.perf_counter() - traffic.t0)
        # New actions stop a fifth of a bucket before its end: the rest is the idle pause.
        end_at = time.perf_counter() + config.bucket_s
        stop_at = end_at - config.bucket_s * 0.2

        async def worker(seed: int, bucket: Bucket = bucket, stop_at: float = stop_at) -> None:
            wrng = random.Random(seed)
            while time.perf_counter() < stop_at:
                if wrng.random() < hostile_share:
                    await traffic.act(wrng.choices(kinds, weights)[0], bucket, wrng)
                else:
                    await traffic.chat(bucket)

        async def sampler(stop_at: float = stop_at) -> None:
            while time.perf_counter() < stop_at:
                samples.append(sample_processes(server.processes(), time.perf_counter() - traffic.t0))
                bar.n = min(bar.total, round(time.perf_counter() - traffic.t0))
                bar.refresh()
                await asyncio.sleep(config.sample_s)

        await asyncio.gather(sampler(), *(worker(rng.randrange(1 << 30)) for _ in range(config.concurrency)))
        await _idle_probe(traffic, bucket, config.idle_timeout_s)
        await asyncio.sleep(max(0.0, end_at - time.perf_counter()))
        bucket.sample = sample_processes(server.processes(), time.perf_counter() - traffic.t0)
        bucket.end_s = time.perf_counter() - traffic.t0
        buckets.append(bucket)
        bar.set_postfix_str(f"{name} {b + 1}/{n_buckets}")
    return buckets


# ------------------------------------------------------------------------------ the targets


@dataclass
class Target:
    name: str
    passed: bool | None  # None: not evaluated (no baseline, or no sample after warm-up)
    detail: str


def least_squares_slope(points: Sequence[tuple[float, float]]) -> float:
    """The slope of the least-squares line through ``points`` (0 for fewer than two distinct x)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in points) / sxx


def evaluate(
    phases: dict[str, list[Bucket]], samples: Sequence[ProcessSample], soak_start_s: float, warmup_s: float
) -> list[Target]:
    """The targets over the phases (the soak phase is ``"soak"``, the baseline ``"baseline"``)."""
    soak = phases["soak"]
    settled = soak_start_s + warmup_s
    fives = {
        kind: n
        for b in (x for p in phases.values() for x in p)
        for kind, c in b.statuses.items()
        for s, n in c.items()
        if s.isdigit() and int(s) >= 500
    }
    left = [
        (b.index, b.idle)
        for p in phases.values()
        for b in p
        if not b.idle or any(b.idle.get(m, 1.0) != 0 for m in METRICS)
    ]
    return [
        Target("no 5xx", not fives, f"5xx by kind: {fives}" if fives else "none"),
        _rss_flat(soak, settled),
        _rss_trend(samples, settled),
        _ttft_against_baseline(soak, phases.get("baseline"), settled),
        Target(
            "idle: KV usage, running, waiting back to 0",
            not left,
            f"{len(left)} idle pauses not at 0: {left[:3]}" if left else "every idle pause at 0",
        ),
    ]


def _rss_flat(soak: list[Bucket], settled: float) -> Target:
    """The server's RSS at the idle pauses after warm-up, against the first of them."""
    name = "RSS after warm-up within 2%"
    idle = [b.sample.rss_total for b in soak if b.sample is not None and b.sample.t_s >= settled]
    if not idle:
        return Target(name, None, "no idle sample after warm-up")
    worst = max(abs(r - idle[0]) / idle[0] for r in idle)
    detail = f"{len(idle)} idle samples, largest change {worst:.2%} of {idle[0] / 2**20:.0f} MiB"
    return Target(name, worst <= RSS_TOLERANCE, detail)


def _rss_trend(samples: Sequence[ProcessSample], settled: float) -> Target:
    """The least-squares growth of the RSS over every sample after warm-up, as a share of its mean."""
    name = "RSS no upward trend"
    later = [(s.t_s, float(s.rss_total)) for s in samples if s.t_s >= settled]
    if len(later) < 2:
        return Target(name, None, "fewer than two samples after warm-up")
    slope = least_squares_slope(later)
    span = later[-1][0] - later[0][0]
    growth = slope * span / (sum(y for _, y in later) / len(later))
    detail = f"least-squares slope {slope * 60 / 2**20:+.2f} MiB/min over {span:.0f}s: {growth:+.2%} of the mean"
    return Target(name, growth <= RSS_TOLERANCE, detail)


def _ttft_against_baseline(soak: list[Bucket], base: list[Bucket] | None, settled: float) -> Target:
    """The normal chats' TTFT p99 in the soak phase (after warm-up, if any) over the baseline phase's."""
    name = "TTFT p99 within 1.5x baseline"
    if base is None:
        return Target(name, None, "no baseline phase (--compare-baseline)")
    p_soak = nearest_rank(
        [t for b in soak if b.start_s >= settled for t in b.ttfts_s] or [t for b in soak for t in b.ttfts_s], 99
    )
    p_base = nearest_rank([t for b in base for t in b.ttfts_s], 99)
    if p_soak is None or not p_base:
        return Target(name, None, "no normal chat answered in a phase")
    ratio = p_soak / p_base
    return Target(name, ratio <= TTFT_RATIO, f"{p_soak * 1e3:.0f} ms vs {p_base * 1e3:.0f} ms: {ratio:.2f}x")


# ------------------------------------------------------------------------------ the report


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _kinds_note(config: dict[str, Any]) -> str:
    """`` (kinds a, b)`` when the run drew from some hostile kinds only, else nothing."""
    kinds = config.get("kinds") or list(HOSTILE_KINDS)
    return "" if set(kinds) == set(HOSTILE_KINDS) else f" (kinds {', '.join(kinds)})"


def markdown(result: dict[str, Any]) -> str:
    """The per-bucket tables of every phase and the targets, as markdown."""
    config = result["config"]
    out = [
        f"Soak: {'cluster, ' + str(config['replicas']) + ' replicas' if config['cluster'] else 'standalone replica'}"
        f" of {config['model']}, {config['concurrency']} clients, hostile share {config['hostile_share']}"
        f"{_kinds_note(config)}, buckets of {config['bucket_s']:.0f}s, warm-up {config['warmup_s']:.0f}s.",
        "",
    ]
    for name, buckets in result["phases"].items():
        kinds: dict[str, Counter[str]] = {}
        for b in buckets:
            for kind, counts in b["statuses"].items():
                kinds.setdefault(kind, Counter()).update(counts)
        kind_rows = [[k, " ".join(f"{s}:{n}" for s, n in sorted(c.items()))] for k, c in sorted(kinds.items())]
        out += [f"### {name}", "", _bucket_table(buckets), "", markdown_table(["kind", "statuses"], kind_rows), ""]
    verdicts = {None: "n/a", True: "PASS", False: "FAIL"}
    target_rows = [[t["name"], verdicts[t["passed"]], t["detail"]] for t in result["targets"]]
    out.append(markdown_table(["target", "result", "detail"], target_rows))
    return "\n".join(out) + "\n"


def _bucket_table(buckets: list[dict[str, Any]]) -> str:
    header = (
        "bucket | start s | requests by status | normal ok | TTFT p50 / p99 ms | RSS MiB | fds | threads"
        " | idle KV / running / waiting"
    )
    rows = []
    for b in buckets:
        idle = b["idle"]
        rows.append(
            [
                b["index"],
                f"{b['start_s']:.0f}",
                " ".join(f"{s}:{n}" for s, n in b["status_totals"].items()),
                b["normal_ok"],
                f"{_ms(b['ttft_p50_s'])} / {_ms(b['ttft_p99_s'])}",
                "-" if b["rss_total_bytes"] is None else f"{b['rss_total_bytes'] / 2**20:.0f}",
                b["fds"],
                b["threads"],
                " / ".join(f"{idle.get(m, float('nan')):g}" for m in METRICS) if idle else "no answer",
            ]
        )
    return markdown_table(header, rows, "rrlrrrrrl")


def plot(result: dict[str, Any], path: Path) -> None:
    """RSS (every sample) and TTFT p99 per bucket over time, one PNG."""
    with figure(path, 100, 2, 1, figsize=(9, 6), sharex=True) as (_, (ax_rss, ax_ttft)):
        samples = result["samples"]
        ax_rss.plot([s["t_s"] for s in samples], [s["rss_total_bytes"] / 2**20 for s in samples], ".-", ms=3)
        ax_rss.set_ylabel("server RSS (MiB)")
        for name, buckets in result["phases"].items():
            points = [(b["end_s"], b["ttft_p99_s"] * 1e3) for b in buckets if b["ttft_p99_s"] is not None]
            if points:
                ax_ttft.plot(*zip(*points), "o-", label=name)
        ax_ttft.set_ylabel("TTFT p99 (ms), normal chats")
        ax_ttft.set_xlabel("time since start (s)")
        ax_ttft.legend()
        for ax in (ax_rss, ax_ttft):
            ax.grid(alpha=0.3)


# ------------------------------------------------------------------------------ running it


async def _drive(config: SoakConfig, server: StandaloneServer | ClusterServer) -> dict[str, Any]:
    samples: list[ProcessSample] = []
    phases: dict[str, list[Bucket]] = {}
    total = config.duration_s + (config.baseline_s if config.compare_baseline else 0.0)
    async with Traffic(config, server.base_url, server.port) as traffic:
        await traffic.warm_up()
        traffic.t0 = time.perf_counter()
        with tqdm(total=round(total), unit="s", desc="soak", file=sys.stderr) as bar:
            phase = functools.partial(run_phase, config, traffic, server, samples=samples, bar=bar)
            if config.compare_baseline:
                phases["baseline"] = await phase(name="baseline", duration_s=config.baseline_s, hostile_share=0.0)
            soak_start = time.perf_counter() - traffic.t0
            phases["soak"] = await phase(name="soak", duration_s=config.duration_s, hostile_share=config.hostile_share)
            bar.n = bar.total
    targets = evaluate(phases, samples, soak_start, config.warmup_s)
    return {
        "config": asdict(config),
        "soak_start_s": round(soak_start, 2),
        "phases": {name: [b.summary() for b in buckets] for name, buckets in phases.items()},
        "samples": [
            {"t_s": round(s.t_s, 2), "rss_total_bytes": s.rss_total, "fds": s.fds, "threads": s.threads}
            for s in samples
        ],
        "targets": [asdict(t) for t in targets],
    }


def run_soak(config: SoakConfig, out_dir: Path) -> dict[str, Any]:
    """Start the server, drive the phases, stop it; write soak.json, soak.md and soak.png into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    server: StandaloneServer | ClusterServer = (
        ClusterServer(config) if config.cluster else StandaloneServer(config, out_dir / "soak-replica.log")
    )
    server.start()
    try:
        result = asyncio.run(_drive(config, server))
    finally:
        server.stop()
    write_json(out_dir / "soak.json", result, newline=True, announce=False)
    (out_dir / "soak.md").write_text(markdown(result))
    plot(result, out_dir / "soak.png")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The soak's flags: :class:`SoakConfig`'s, ``--kinds`` and ``--out-dir``."""
    group = add_flags(parser, SoakConfig, "soak")
    group.add_argument(
        "--kinds",
        type=_kinds_arg,
        default=SoakConfig.kinds,
        help=f"comma-separated hostile kinds to draw from (default: all of {','.join(HOSTILE_KINDS)})",
    )
    group.add_argument(
        "--out-dir",
        type=Path,
        default=Path("results"),
        help="where soak.json, soak.md and soak.png go (default: %(default)s)",
    )


def _kinds_arg(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixserve.loadtest.soak", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = from_cli_args(SoakConfig, args)
    except ValueError as exc:
        parser.error(str(exc))
    result = run_soak(config, args.out_dir)
    print(markdown(result))
    for t in result["targets"]:
        verdict = "n/a " if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        print(f"{verdict} {t['name']}: {t['detail']}")
    return 0 if all(t["passed"] is not False for t in result["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
