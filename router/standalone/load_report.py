"""A replica's load read from its Prometheus ``/metrics`` text: running and waiting requests, KV usage.

Job: turn the exposition text of any OpenAI-compatible server the router fronts into
the ``ReplicaLoad`` the policies read (router/policies/base.py). The gauges, by server:

* prefixserve and vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (older vLLM: ``vllm:gpu_cache_usage_perc``);
* SGLang: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``.

A gauge with several samples (one per model or engine label set) counts their sum
(requests) or their largest (KV usage). Text without a running or waiting gauge
gives None: the router then knows the replica by its own in-flight count alone.

The LoRA adapters a replica holds: prefixserve names those loaded in host memory
(``prefixserve:lora_adapters_loaded_info{loaded_lora_adapters="a,b"}``); vLLM only those
its running and waiting requests use (``vllm:lora_requests_info``'s
``running_lora_adapters`` and ``waiting_lora_adapters`` labels), surely loaded too. The
replica's ``adapters`` are their union, and its ``adapter_capacity`` the first series'
``max_cpu_loras`` label, else vLLM's ``max_lora``.

The KV capacity: prefixserve and vLLM publish their cache settings as the labels of
``vllm:cache_config_info``; ``num_gpu_blocks`` times ``block_size`` is the tokens the cache holds.

Pure stdlib: a line parser for the gauges above, not a general Prometheus parser.
"""

from __future__ import annotations

import math
import re

from prefixserve.router.policies import ReplicaLoad

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_WANTED = frozenset((*RUNNING, *WAITING, *KV_USAGE))
# Info series whose labels name adapters: metric -> its labels that do.
ADAPTER_LABELS = {
    "prefixserve:lora_adapters_loaded_info": ("loaded_lora_adapters",),
    "vllm:lora_requests_info": ("running_lora_adapters", "waiting_lora_adapters"),
}
CAPACITY_LABELS = ("max_cpu_loras", "max_lora")  # the first found wins
CACHE_CONFIG = "vllm:cache_config_info"
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> dict[str, list[float]]:
    """The values of the wanted gauges' samples in exposition ``text``, by metric name.

    Comment lines, other metrics and samples whose value is not a finite number are skipped.
    """
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            if close < brace:
                continue
            rest = line[close + 1 :].split()
        else:
            name, _, tail = line.partition(" ")
            rest = tail.split()
        if name not in _WANTED or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isfinite(value):
            out.setdefault(name, []).append(value)
    return out


def adapters(text: str) -> tuple[frozenset[str], int]:
    """The LoRA adapter names the info series of ``ADAPTER_LABELS`` name in exposition ``text``, and
    how many the replica holds at most (0: not said)."""
    names: set[str] = set()
    capacity: dict[str, int] = {}
    for line in text.splitlines():
        brace = line.find("{")
        if brace <= 0:
            continue
        wanted = ADAPTER_LABELS.get(line[:brace].strip())
        if wanted is None:
            continue
        for label, value in _LABEL.findall(line[brace : line.rfind("}") + 1]):
            if label in wanted:
                names.update(n for n in value.split(",") if n)
            elif label in CAPACITY_LABELS and value.isdigit():
                capacity[label] = int(value)
    return frozenset(names), next((capacity[c] for c in CAPACITY_LABELS if c in capacity), 0)


def kv_capacity_tokens(text: str) -> int:
    """The tokens of KV the cache settings in exposition ``text`` say the replica holds (0: not said)."""
    for line in text.splitlines():
        if line.startswith(CACHE_CONFIG + "{"):
            labels = dict(_LABEL.findall(line[len(CACHE_CONFIG) : line.rfind("}") + 1]))
            blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
            return int(blocks) * int(size) if blocks.isdigit() and size.isdigit() else 0
    return 0


def _count(found: dict[str, list[float]], names: tuple[str, ...]) -> int | None:
    for name in names:
        if name in found:
            return max(0, round(sum(found[name])))
    return None


def parse_load(text: str) -> ReplicaLoad | None:
    """The ReplicaLoad that ``/metrics`` text reports (the module docstring), or None when it reports none."""
    found = samples(text)
    running = _count(found, RUNNING)
    waiting = _count(found, WAITING)
    if running is None and waiting is None:
        return None
    kv = 0.0
    for name in KV_USAGE:
        if name in found:
            kv = min(1.0, max(0.0, max(found[name])))
            break
    held, capacity = adapters(text)
    return ReplicaLoad(
        num_waiting=waiting or 0,
        num_running=running or 0,
        kv_usage=kv,
        adapters=held,
        adapter_capacity=capacity,
        kv_capacity_tokens=kv_capacity_tokens(text),
    )
