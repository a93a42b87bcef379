"""The standalone router's own cost: latency it adds over a direct connection to an instant upstream.

``python -m prefixserve.loadtest.bench_router_overhead`` starts, as child processes, an
OpenAI-compatible upstream that answers every chat request at once with a short SSE
stream (a benchmark fixture: no model, no tokenizer, its few chunks written as soon as
the request is read) and ``prefixserve router`` in front of it, then streams the same
chat requests with the harness's closed-loop client (``--concurrency`` streams, 64 by
default; with ``--rate R``, R requests/s over those streams instead, each sent at its
slot, so that neither path is saturated and the difference is the router's per-request
cost rather than its queue) alternately straight to the upstream and through the router: each round runs
both phases, the order swapped every round, so that a drift in the machine's load falls
on both. Each run reports TTFT and total latency p50/p99 of the direct and the routed
requests and their difference (the router's added latency); ``--runs`` runs.

What the difference contains: the router's HTTP server, its decision (``--policy``,
``placed`` by default, over requests with a handful of system prompts), the upstream
connection through its client pool and the chunk relay. What it does not: any model
time. The client, the router and the upstream share the machine's cores, so the figures
are only as quiet as the machine: the 1-minute load average is recorded before and
after each run, and the router process's CPU time per routed request (from /proc), a cost
that does not depend on what else runs. ``--profile-router PATH`` runs the router under cProfile and writes its
stats to PATH when it stops.

Output: a markdown table a run, ``--out`` (JSON: the settings, each run's summaries and
the load). ``... bench_router_overhead upstream PORT`` serves the upstream alone, and
``... bench_router_overhead profile-router OUT router ARGS`` runs ``prefixserve router ARGS`` under cProfile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from prefixserve.common.config_util import from_cli_args
from prefixserve.common.logs import add_verbose_flag
from prefixserve.loadtest.harness.cli import add_flags, flag_field, plan_and_run
from prefixserve.loadtest.harness.client import RequestRecord, run_load_async, stream_one
from prefixserve.loadtest.harness.report import fmt, markdown_table, write_json
from prefixserve.loadtest.harness.server import HOST, free_port, running_server, server_env
from prefixserve.loadtest.harness.stats import percentile
from prefixserve.loadtest.peer_routers import (
    PEER_ROUTERS,
    SMG,
    PeerRouterVenv,
    smg_command,
    vllm_router_command,
)

TARGETS = ("direct", "router")
PROTOCOL_RELAY = "protocol-relay"  # loadtest/harness/protocol_relay.py: no routing, the floor of a Python relay
ROUTERS = ("prefixserve", *PEER_ROUTERS, PROTOCOL_RELAY)
SSE_TYPE = (b"content-type", b"text/event-stream")


# -- the upstream (a fixture that answers at once) ---------------------------------------------------


def upstream_events(chunks: int) -> list[bytes]:
    """The SSE events of one answer: a role delta, ``chunks`` one-word deltas, the usage, ``[DONE]``."""

    def event(payload: object) -> bytes:
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def delta(d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-0",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": d, "finish_reason": finish}],
        }

    usage = {"prompt_tokens": 16, "completion_tokens": chunks, "total_tokens": 16 + chunks}
    return [
        event(delta({"role": "assistant", "content": ""})),
        *(event(delta({"content": f" w{i}"}, "stop" if i == chunks - 1 else None)) for i in range(chunks)),
        event({"id": "chatcmpl-0", "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": usage}),
        b"data: [DONE]\n\n",
    ]


class InstantUpstream:
    """A bare ASGI app: ``/health``, ``/v1/models``, ``/metrics`` and an instant streamed chat answer."""

    def __init__(self, chunks: int = 4) -> None:
        self.events = upstream_events(chunks)
        self.models = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        self.metrics = b'vllm:num_requests_running{model_name="m"} 0\nvllm:num_requests_waiting{model_name="m"} 0\n'

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        more = True
        while more:  # the body is read whole (and not parsed: the answer does not depend on it)
            message = await receive()
            more = message.get("more_body", False)
        if path.endswith("/completions"):
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for e in self.events:
                await send({"type": "http.response.body", "body": e, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        status, body, kind = {
            "/health": (200, b"", b"text/plain"),
            "/v1/models": (200, self.models, b"application/json"),
            "/metrics": (200, self.metrics, b"text/plain"),
        }.get(path, (404, b"", b"text/plain"))
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": body})


def serve_upstream(port: int, chunks: int) -> int:
    import uvicorn

    uvicorn.run(InstantUpstream(chunks), host=HOST, port=port, log_level="warning", access_log=False)
    return 0


# -- the load ------------------------------------------------------------------------------------------


@dataclass
class OverheadConfig:
    concurrency: int = flag_field(64, "most streams in flight at once")
    rate: float = flag_field(
        0.0, "requests/s across the streams, each sent at its slot (0: closed loop, each as the last ends)"
    )
    requests: int = flag_field(1000, "requests per phase (one target, one round)")
    rounds: int = flag_field(4, "rounds per run; each runs a direct and a routed phase, the order swapped each round")
    runs: int = flag_field(2, "runs, each summarized on its own")
    warmup: int = flag_field(256, "requests to each target before the first run (not counted)")
    chunks: int = flag_field(4, "content chunks in each upstream answer")
    keys: int = flag_field(8, "distinct system prompts (routing keys) among the requests")
    policy: str = flag_field("placed", "the router's --policy")
    router: str = flag_field(
        "prefixserve",
        "the router measured: prefixserve's standalone router, a peer from PyPI (smg, vllm-router; "
        "installed by the benchmark into a venv of its own) with --peer-policy, or protocol-relay "
        "(loadtest/harness/protocol_relay.py: bytes passed through on uvloop and httptools, no routing)",
    )
    peer_policy: str = flag_field("round_robin", "the peer router's --policy")
    out: str = flag_field("router_overhead.json", "where the JSON result goes")
    profile_router: str = flag_field("", "run the router under cProfile and write its stats here")
    logs: str = flag_field("results/router_overhead_logs", "folder for the upstream's and the router's logs")

    def __post_init__(self) -> None:
        for name in ("concurrency", "requests", "rounds", "runs", "chunks", "keys"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name} must be an integer >= 1, got {v!r}")
        if not (self.rate >= 0 and math.isfinite(self.rate)):
            raise ValueError(f"--rate must be a finite number >= 0, got {self.rate!r}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {ROUTERS}, got {self.router!r}")
        if self.router != "prefixserve" and self.profile_router:
            raise ValueError("--profile-router profiles prefixserve's router only")


def bodies(n: int, keys: int, offset: int = 0) -> list[dict[str, Any]]:
    """``n`` small chat bodies over ``keys`` system prompts."""
    return [
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": f"You are assistant number {(offset + i) % keys}."},
                {"role": "user", "content": f"Question {offset + i}: what is the answer?"},
            ],
            "max_tokens": 8,
        }
        for i in range(n)
    ]


def phase_order(round_index: int) -> tuple[str, str]:
    """The targets' order in a round: direct first in even rounds, the router first in odd ones."""
    return TARGETS if round_index % 2 == 0 else (TARGETS[1], TARGETS[0])


def summarize(records: dict[str, list[RequestRecord]]) -> dict[str, Any]:
    """Per target TTFT and total latency p50/p99 (ms) of its successful requests, and router minus direct."""
    out: dict[str, Any] = {}
    for target in TARGETS:
        ok = [r for r in records.get(target, []) if r.ok]
        ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        total = [r.e2e_s * 1000 for r in ok]
        out[target] = {
            "requests": len(records.get(target, [])),
            "errors": len(records.get(target, [])) - len(ok),
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
            "total_p50_ms": percentile(total, 50),
            "total_p99_ms": percentile(total, 99),
        }
    added: dict[str, float | None] = {}
    for metric in ("ttft_p50_ms", "ttft_p99_ms", "total_p50_ms", "total_p99_ms"):
        d, r = out["direct"][metric], out["router"][metric]
        added[metric] = None if d is None or r is None else r - d
    out["added"] = added
    return out


def load_average() -> float:
    return os.getloadavg()[0]


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) process ``pid`` has used so far; None where /proc cannot tell."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


async def paced_load(url: str, batch: list[dict[str, Any]], concurrency: int, rate: float) -> list[RequestRecord]:
    """``batch`` sent at ``rate`` requests/s (request i at i / rate s) by ``concurrency`` streams: a request
    whose slot comes while every stream is busy waits for one (its times start when it is sent)."""
    url = f"{url}/v1/chat/completions"
    records: list[RequestRecord | None] = [None] * len(batch)
    cursor = iter(range(len(batch)))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=30.0), limits=limits) as client:

        async def stream() -> None:
            for i in cursor:
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                records[i] = await stream_one(client, url, i, batch[i], {}, t0)

        await asyncio.gather(*(stream() for _ in range(min(concurrency, len(batch)))))
    return [r for r in records if r is not None]


async def run_rounds(urls: dict[str, str], config: OverheadConfig, offset: int) -> dict[str, list[RequestRecord]]:
    records: dict[str, list[RequestRecord]] = {t: [] for t in TARGETS}
    for i in range(config.rounds):
        for target in phase_order(i):
            batch = bodies(config.requests, config.keys, offset)
            offset += config.requests
            if config.rate:
                records[target] += await paced_load(urls[target], batch, config.concurrency, config.rate)
            else:
                records[target] += await run_load_async(urls[target], batch, config.concurrency, timeout_s=60.0)
    return records


def table(summary: dict[str, Any]) -> str:
    rows = []
    for label in (*TARGETS, "added"):
        s = summary[label]
        rows.append(
            [
                label,
                fmt(s["ttft_p50_ms"], ".2f"),
                fmt(s["ttft_p99_ms"], ".2f"),
                fmt(s["total_p50_ms"], ".2f"),
                fmt(s["total_p99_ms"], ".2f"),
                s.get("requests", ""),
                s.get("errors", ""),
            ]
        )
    return markdown_table(
        "path | TTFT p50 ms | TTFT p99 ms | total p50 ms | total p99 ms | requests | errors", rows, "lrrrrrr"
    )


def profile_router(out: str, argv: list[str]) -> int:
    """``prefixserve router`` (``argv``) under cProfile; its stats written to ``out`` when SIGTERM stops it.

    uvicorn re-raises the signal that stopped it once it has shut down: the handler installed
    here turns it into an exit this function sees, so the stats are written.
    """
    import cProfile
    import signal

    from prefixserve.router.cli import main as cli_main

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    profile = cProfile.Profile()
    try:
        return int(profile.runcall(cli_main, argv) or 0)
    except SystemExit:
        return 0
    finally:
        profile.dump_stats(out)


def router_command(upstream: str, port: int, config: OverheadConfig, venv: PeerRouterVenv | None = None) -> list[str]:
    """The measured router over the upstream: ``prefixserve router`` (under cProfile with
    ``--profile-router``), the protocol-level relay, or a peer router from ``venv`` (PeerRouterVenv.ensure)."""
    if config.router == PROTOCOL_RELAY:
        up_port = upstream.rsplit(":", 1)[1]
        return [sys.executable, "-m", "prefixserve.loadtest.harness.protocol_relay", str(port), up_port]
    if config.router != "prefixserve":
        if venv is None:
            raise ValueError(f"{config.router} needs the peer routers' venv")
        build = smg_command if config.router == SMG else vllm_router_command
        return build(venv, config.peer_policy, [upstream], HOST, port, free_port())
    me = [sys.executable, "-m", "prefixserve.loadtest.bench_router_overhead"]
    head = (
        [*me, "profile-router", config.profile_router]
        if config.profile_router
        else [sys.executable, "-m", "prefixserve.router.cli"]
    )
    return [
        *head,
        "router",
        "--replica",
        upstream,
        "--port",
        str(port),
        "--host",
        HOST,
        "--policy",
        config.policy,
        "--log-level",
        "warning",
    ]


def run(config: OverheadConfig) -> dict[str, Any]:
    logs = Path(config.logs)
    up_port, router_port = free_port(), free_port()
    urls = {"direct": f"http://{HOST}:{up_port}", "router": f"http://{HOST}:{router_port}"}
    upstream_cmd = [sys.executable, "-m", "prefixserve.loadtest.bench_router_overhead", "upstream", str(up_port)]
    upstream_cmd += ["--chunks", str(config.chunks)]
    env = server_env()
    venv = PeerRouterVenv.default().ensure() if config.router in PEER_ROUTERS else None
    result: dict[str, Any] = {"config": asdict(config), "cpus": os.cpu_count(), "runs": []}
    with (
        running_server(upstream_cmd, env, urls["direct"] + "/health", logs / "upstream.log", 60.0),
        running_server(
            router_command(urls["direct"], router_port, config, venv),
            env,
            urls["router"] + ("/readiness" if config.router in PEER_ROUTERS else "/health"),
            logs / "router.log",
            60.0,
        ) as router,
    ):
        if config.warmup:
            for target in TARGETS:
                asyncio.run(run_load_async(urls[target], bodies(config.warmup, config.keys), config.concurrency))
        offset = 0
        for n in range(config.runs):
            load_before, cpu_before = load_average(), cpu_seconds(router.pid)
            records = asyncio.run(run_rounds(urls, config, offset))
            cpu_after = cpu_seconds(router.pid)
            offset += 2 * config.rounds * config.requests
            summary = summarize(records)
            summary["load_before"], summary["load_after"] = load_before, load_average()
            # The router's CPU time per request it routed (its probes of the upstream included): its
            # cost whatever else the machine runs, where its latency is only as quiet as the machine.
            routed = len(records["router"])
            summary["router_cpu_ms_per_request"] = (
                None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before) * 1000 / routed
            )
            result["runs"].append(summary)
            cpu = fmt(summary["router_cpu_ms_per_request"], ".3f")
            print(
                f"\nrun {n + 1} (1-minute load {load_before:.2f} -> {summary['load_after']:.2f}; "
                f"router CPU {cpu} ms per request)"
            )
            print(table(summary))
            write_json(config.out, result, announce=False)
    write_json(config.out, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, OverheadConfig, "benchmark")
    add_verbose_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["upstream"]:
        up = argparse.ArgumentParser(prog="bench_router_overhead upstream")
        up.add_argument("port", type=int)
        up.add_argument("--chunks", type=int, default=4)
        ns = up.parse_args(args[1:])
        return serve_upstream(ns.port, ns.chunks)
    if args[:1] == ["profile-router"]:
        return profile_router(args[1], args[2:])

    def plan(ns: argparse.Namespace) -> OverheadConfig:
        return from_cli_args(OverheadConfig, ns)

    def go(_: argparse.Namespace, config: OverheadConfig) -> int:
        started = time.monotonic()
        result = run(config)
        print(f"{time.monotonic() - started:.0f} s")
        return 0 if all(r[t]["errors"] == 0 for r in result["runs"] for t in TARGETS) else 1

    return plan_and_run(build_parser(), plan, go, args)


if __name__ == "__main__":
    sys.exit(main())
