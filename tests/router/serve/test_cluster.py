"""The prefixserve app on a real multi-node Ray cluster: routing, affinity, failures, scaling.

One ``ray.cluster_utils.Cluster`` (CPU-less head + 2 worker nodes) per module,
3 engine replicas of a tiny random Llama, 2 ingress replicas, real HTTP. The
ring is checked against router/ring.py over the live replicas' names.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from cluster_helpers import (
    INGRESS_HEADER,
    REPLICA_HEADER,
    chat,
    cluster_fixture,
    deploy,
    engine_actors,
    engine_replicas,
    ring_members,
    wait_for_replicas,
    wait_for_ring,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_helpers import PrometheusProcess, dashboard_queries, find_prometheus
from server_helpers import metric
from tool_helpers import NAMED, QUESTION, TOOLS, streamed_tool_calls, valid_arguments

from prefixserve.router.ring import HashRing
from prefixserve.router.routing_key import PREFIX_HASH_HEADER, prefix_hash

pytestmark = pytest.mark.slow

PORT = 18431
NUM_INGRESS = 2
ATTEMPTS_HEADER = "X-Prefixserve-Attempts"


def app_args(model: str, num_replicas: int) -> dict:
    return {
        "engine": {
            "model": model,
            "num_kv_blocks": 512,
            "max_num_seqs": 2,
            "max_model_len": 1024,
            # tool_choice="auto" (the agent loop's answer turn) needs both, as with vLLM.
            "tool_call_parser": "hermes",
            "enable_auto_tool_choice": True,
        },
        "num_replicas": num_replicas,
        "max_ongoing_requests": 32,
        "ray_actor_options": {"num_cpus": 0.5},
        "health_check_period_s": 1.0,
        # epsilon 2: a router counts a request done when Serve runs its completion callback,
        # which can come after the client has the response, so a sequential test's next
        # request can see the last one still in flight. With one such request the cap is
        # ceil((1 + epsilon) * 2 / R): 1 at epsilon 1 with the scale-up test's four replicas,
        # which spills the next key of the same owner; 2 at epsilon 2 for R <= 5.
        "router": {"policy": "bounded_load", "epsilon": 2.0, "stats_period_s": 1.0},
        # A sliver of CPU keeps the ingress replicas off the CPU-less head node, where
        # the only HTTP proxy runs: the proxy prefers replicas on its own node.
        "ingress": {"num_replicas": NUM_INGRESS, "ray_actor_options": {"num_cpus": 0.1}},
    }


cluster = cluster_fixture(num_workers=2)


@pytest.fixture(scope="module")
def base(cluster, ckpt) -> str:
    url = deploy(app_args(ckpt, 3), PORT)
    wait_for_ring(url, wait_for_replicas(3), NUM_INGRESS)
    return url


def words(rng: random.Random, n: int) -> str:
    vocab = "alpha beta gamma delta river stone cloud paper garden window silver orange market".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def key_owner(keys: list[str]) -> dict[str, str]:
    ring = HashRing(engine_replicas())
    return {k: ring.owner(k) for k in keys}


def decision_kinds(metrics_text: str) -> dict[tuple[str, str], float]:
    """Every ingress router's decisions summed by (replica, kind), from /metrics."""
    kinds: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "prefixserve_router_decisions_total":
                kinds[(s.labels["replica"], s.labels["kind"])] += s.value
    return dict(kinds)


def test_same_system_prompt_lands_on_one_replica_and_hits_its_cache(base):
    rng = random.Random(101)
    system = "You are a careful assistant. " + words(rng, 60)
    results = [chat(base, words(rng, 6), system=system) for _ in range(5)]
    assert all(r.status == 200 for r in results), [r.body for r in results]
    assert {r.replica for r in results} == {key_owner([prefix_hash(system)])[prefix_hash(system)]}
    assert all(r.cached_tokens >= 48 for r in results[1:]), [r.cached_tokens for r in results]


def test_replicas_report_routing_stats_and_metrics_name_every_replica(base):
    from ray import serve

    handle = serve.get_deployment_handle("Engine", app_name="prefixserve")
    stats = handle.broadcast("record_routing_stats").results(timeout_s=60)
    assert len(stats) == 3
    for s in stats:
        assert set(s) == {
            "seq",
            "kv_usage",
            "num_running",
            "num_waiting",
            "queued_prefill_tokens",
            "kv_capacity_tokens",
            "kv_events",
            "rank",
        }
        assert 0.0 <= s["kv_usage"] <= 1.0 and s["num_running"] >= 0 and s["num_waiting"] >= 0
        assert s["kv_capacity_tokens"] > 0 and s["kv_capacity_tokens"] % 16 == 0  # blocks x block size
        assert s["queued_prefill_tokens"] >= 0 and s["kv_events"]["format"] == 1
    assert sorted(s["rank"] for s in stats) == [0, 1, 2]  # Serve's ranks: what the ring names the replicas by
    response = httpx.get(f"{base}/metrics", timeout=60)
    text = response.text
    for name in engine_replicas():
        assert metric(text, "vllm:prefix_cache_queries_total", model_name="tiny", engine="0", replica=name) >= 0
    assert "prefixserve_router_decision_seconds_count" in text
    # Every ingress replica's router series, each under its own name, whichever one answered.
    ingresses = set(ring_members(text))
    assert len(ingresses) == NUM_INGRESS and response.headers[INGRESS_HEADER] in ingresses
    # The ingress's /health asks the engine replicas (Serve's check_health), not itself.
    health = httpx.get(f"{base}/health", timeout=60)
    assert health.status_code == 200 and health.headers[INGRESS_HEADER]


@pytest.mark.skipif(find_prometheus() is None, reason="prometheus is not installed (scripts/system-deps.sh)")
def test_every_dashboard_panel_shows_plausible_values_through_the_serve_proxy(base, tmp_path):
    """A real Prometheus scrapes the ingress through Serve's proxy; every dashboard query answers."""
    rng = random.Random(103)
    systems = ["You are a careful assistant. " + words(rng, 60) for _ in range(3)]
    stop = threading.Event()
    statuses: list[int] = []

    def load() -> None:  # keeps requests flowing while the rate windows fill
        with httpx.Client(timeout=120) as http:
            i = 0
            while not stop.is_set() and (i < 12 or not stop.wait(1.0)):
                statuses.append(chat(base, words(rng, 6), system=systems[i % 3], client=http).status)
                i += 1

    # The ingress's /metrics gathers every ingress and engine replica's text (up to
    # METRICS_TIMEOUT_S): scrape every 3 s, so that a slow fan-out is not a failed scrape.
    with PrometheusProcess([base.removeprefix("http://")], tmp_path, scrape_interval_s=3) as prometheus:
        prometheus.wait_until(prometheus.targets_up, 60.0, "the ingress was not scraped")
        sender = threading.Thread(target=load, daemon=True)
        sender.start()
        try:
            # The module's app runs bounded_load without KV tiers; placed's panels are proven in the
            # placed test below, the tiers' in tests/test_observability.py.
            queries = [q for q in dashboard_queries() if not (q.needs_placed or q.needs_tiers or q.needs_flow)]
            prometheus.evaluate(queries, timeout_s=90.0)
        finally:
            stop.set()
            sender.join(timeout=130)
    assert statuses and set(statuses) == {200}, statuses


def test_x_request_id_reaches_the_engine_and_comes_back_once(base):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    sent = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-9"}, timeout=120)
    assert sent.status_code == 200 and sent.headers.get_list("x-request-id") == ["trace-9"]
    assert sent.json()["id"] == "chatcmpl-trace-9"  # the engine request carried it
    generated = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    (request_id,) = generated.headers.get_list("x-request-id")  # Serve's proxy made one up
    assert generated.json()["id"] == f"chatcmpl-{request_id}"


def test_concurrent_requests_with_one_request_id_all_run(base):
    body = {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(
                *(http.post(f"{base}/v1/completions", json=body, headers={"X-Request-Id": "same-9"}) for _ in range(4))
            )

    answers = asyncio.run(main())
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert all(a.headers.get_list("x-request-id") == ["same-9"] for a in answers)
    assert {a.json()["id"] for a in answers} == {"cmpl-same-9"}


def serve_log_lines(deployment: str) -> dict[Path, list[str]]:
    """The lines each of the app's ``deployment`` replicas logged so far, per Serve log file."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return {
        path: path.read_text(errors="replace").splitlines()
        for path in sorted(logs.glob(f"replica_prefixserve_{deployment}_*.log"))
    }


def new_serve_log_lines(before: dict[Path, int]) -> list[str]:
    """Lines the Engine and Ingress replicas logged since ``before`` (line counts per file; a file
    that appeared since, a replica started meanwhile, counts from its first line)."""
    return [
        line
        for deployment in ("Engine", "Ingress")
        for path, lines in serve_log_lines(deployment).items()
        for line in lines[before.get(path, 0) :]
    ]


def test_prompt_too_long_is_a_400_with_no_traceback_in_any_replica_log(base):
    before = {path: len(lines) for d in ("Engine", "Ingress") for path, lines in serve_log_lines(d).items()}
    # Few characters per token, so only the rendered chat shows it is too long: the engine refuses it.
    rendered = {
        "messages": [{"role": "system", "content": "x1 " * 1500}, {"role": "user", "content": "q"}],
        "max_tokens": 1,
    }
    # More messages than can fit: the ingress refuses it before validating them.
    many = {
        "messages": [{"role": "system", "content": ""}] * 50_000 + [{"role": "user", "content": "q"}],
        "max_tokens": 1,
    }
    with httpx.Client(timeout=120) as http:
        for i, body in enumerate([rendered, many] * 2):
            answer = http.post(f"{base}/v1/chat/completions", json=body, headers={"X-Request-Id": f"long-{i}"})
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == "context_length_exceeded"
            assert answer.json()["error"]["param"] == "messages"
        assert chat(base, "still serving").status == 200
    # Serve writes each request's access line (with its X-Request-Id) once it is answered: wait for
    # every refusal's, so that whatever the replicas logged for the refusals is in the files.
    deadline = time.monotonic() + 60
    while True:
        new = new_serve_log_lines(before)
        if all(any(f"long-{i}" in line and " 400 " in line for line in new) for i in range(4)):
            break
        assert time.monotonic() < deadline, new[-40:]
        time.sleep(0.5)
    assert not [line for line in new if "Traceback" in line or "PromptTooLongError" in line], new[-40:]


def test_vllm_sampling_fields_cross_the_ray_path(base):
    # prompt_logprobs, echo and penalties ride the deltas from the engine replica through the ingress.
    body = {
        "prompt": "one two three four",
        "max_tokens": 3,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        "prompt_logprobs": 1,
        "presence_penalty": -2.0,
        "repetition_penalty": 1.0,
        "min_p": 0.1,
    }
    answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["text"].startswith("one two three four")
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) > 1
    assert choice["logprobs"]["token_logprobs"][0] is None
    ids = httpx.post(
        f"{base}/v1/completions", json={"prompt": [300, 301, 302], "max_tokens": 2, "echo": True}, timeout=120
    )
    assert ids.status_code == 200, ids.text
    refused = httpx.post(f"{base}/v1/completions", json={**body, "presence_penalty": 3}, timeout=120)
    assert refused.status_code == 400 and "presence_penalty" in refused.json()["error"]["message"]


def test_the_ingress_ignores_and_counts_fields_it_does_not_know_as_a_replica_does(base):
    # vllm-router re-serialises every chat request with SGLang's fields.
    body = {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
        "no_stop_trim": False,
        "separate_reasoning": True,
    }
    answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    metrics = httpx.get(f"{base}/metrics", timeout=60).text
    counted = [
        line
        for line in metrics.splitlines()
        if line.startswith("prefixserve_router_ignored_request_fields_total") and 'field="no_stop_trim"' in line
    ]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1
    nested = {**body, "messages": [{"role": "user", "content": "hi", "no_such_key": 1}]}
    assert httpx.post(f"{base}/v1/chat/completions", json=nested, timeout=120).status_code == 400


@pytest.fixture()
def openai_client(base):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


# Grammar-constrained (required, named): a random model's arguments parse and validate too.
TOOL_REQUEST = dict(tools=TOOLS, parallel_tool_calls=False, max_tokens=160, temperature=0)


@pytest.fixture()
def model(openai_client) -> str:
    return openai_client.models.list().data[0].id


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_cross_the_ray_path_collected_and_streamed(openai_client, model, tool_choice):
    kwargs = dict(TOOL_REQUEST, model=model, messages=QUESTION, tool_choice=tool_choice)
    finish_reason = "tool_calls" if tool_choice == "required" else "stop"
    choice = openai_client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == finish_reason, choice
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1 and calls[0].id.startswith("call_"), choice
    if tool_choice == NAMED:
        assert calls[0].function.name == "find_flights"
    collected = valid_arguments(calls[0].function.name, calls[0].function.arguments)
    streamed, finish = streamed_tool_calls(openai_client, **kwargs)
    assert finish == finish_reason and [c["name"] for c in streamed] == [calls[0].function.name]
    assert valid_arguments(streamed[0]["name"], streamed[0]["arguments"]) == collected


def _turn(client, stream: bool, **kwargs):
    """One chat turn through the cluster: (message content, tool calls as dicts, finish reason,
    usage, engine replica)."""
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**kwargs)
        choice = raw.parse().choices[0]
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or ()
        ]
        return choice.message.content, calls, choice.finish_reason, raw.parse().usage, raw.headers[REPLICA_HEADER]
    raw = client.chat.completions.with_raw_response.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    content, pieces, finish, usage = "", {}, None, None
    for chunk in raw.parse():
        usage = chunk.usage or usage
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                if d.id is not None:
                    pieces[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                pieces[d.index]["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content or None, [pieces[i] for i in sorted(pieces)], finish, usage, raw.headers[REPLICA_HEADER]


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_an_agent_loop_through_the_cluster_stays_on_one_replica_and_hits_its_cache(openai_client, model, stream):
    """Call (tool_choice="required"), tool result, answer (auto): the same system prompt and tools
    are one routing key, so both turns reach one engine replica and the answer reuses the call's
    prompt from its cache."""
    rng = random.Random(29 + stream)
    # Its own system prompt per case: a key no earlier test has warmed.
    messages = [{"role": "system", "content": f"{QUESTION[0]['content']} {words(rng, 40)}"}, QUESTION[1]]
    _, calls, finish, call_usage, call_replica = _turn(
        openai_client, stream, **dict(TOOL_REQUEST, model=model, messages=messages, tool_choice="required")
    )
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["id"].startswith("call_"), calls
    call = calls[0]
    args = valid_arguments(call["name"], call["arguments"])
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        }
    )
    result = {"forecast": "light rain", "city": args.get("city") or args.get("to")}
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})

    # min_tokens: a random model's first token may be its EOS; the answer must say something.
    content, answer_calls, finish, usage, replica = _turn(
        openai_client,
        stream,
        model=model,
        messages=messages,
        tools=TOOLS,
        max_tokens=16,
        temperature=0,
        extra_body={"min_tokens": 4},
    )
    assert finish in ("stop", "length", "tool_calls") and (content or answer_calls)
    assert replica == call_replica
    # The system prompt, the tools and the call turn came from that replica's prefix cache.
    assert usage.prompt_tokens > call_usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > call_usage.prompt_tokens // 2


def test_responses_cross_the_ray_path_and_continue_whichever_ingress_replica_stored_them(openai_client, model, base):
    """/v1/responses through the ingress: each ingress replica stores what it answered and asks its
    siblings for what it lacks, so every continuation and GET finds its response; one system prompt
    keeps the conversation on one engine replica, whose prefix cache the continuations hit."""
    rng = random.Random(47)
    instructions = f"You are terse. {words(rng, 40)}"
    kwargs = dict(model=model, instructions=instructions, temperature=0, max_output_tokens=8)
    raw = openai_client.responses.with_raw_response.create(input=words(rng, 4), **kwargs)
    first, replica = raw.parse(), raw.headers[REPLICA_HEADER]
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    previous = first
    for _ in range(4):
        raw = openai_client.responses.with_raw_response.create(
            input=words(rng, 4), previous_response_id=previous.id, **kwargs
        )
        answer = raw.parse()
        assert answer.previous_response_id == previous.id and raw.headers[REPLICA_HEADER] == replica
        assert answer.usage.input_tokens > previous.usage.input_tokens
        assert answer.usage.input_tokens_details.cached_tokens > 0
        previous = answer
    events = list(
        openai_client.responses.create(input=words(rng, 4), previous_response_id=previous.id, stream=True, **kwargs)
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0
    for _ in range(4):
        assert openai_client.responses.retrieve(first.id).id == first.id
    text = httpx.get(f"{base}/metrics", timeout=30).text
    assert metric(text, "prefixserve_router_response_store_entries") >= 6
    openai_client.responses.delete(first.id)
    with pytest.raises(pytest.importorskip("openai").NotFoundError):
        openai_client.responses.retrieve(first.id)


def test_a_client_that_disconnects_mid_stream_frees_its_replica(base):
    before = {path: len(lines) for d in ("Engine", "Ingress") for path, lines in serve_log_lines(d).items()}
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 800, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
            replica = response.headers[REPLICA_HEADER]
            for line in response.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # one token arrived: hang up
    from ray import serve

    handle = serve.get_deployment_handle("Engine", app_name="prefixserve")
    deadline = time.monotonic() + 30
    while True:
        stats = {s["replica"]: s for s in handle.broadcast("engine_stats").results(timeout_s=60)}
        if stats[replica]["num_running"] == 0 and stats[replica]["num_waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"the abandoned request still runs: {stats[replica]}"
        time.sleep(0.2)
    # The ingress routers hear the replica idle one routing-stats report later; until then a
    # router still counts the abandoned request and would spill the next test's keys. Wait
    # until every ingress replica routes the replica's own keys to it again.
    rng = random.Random(106)
    owners = key_owner([f"{rng.getrandbits(64):016x}" for _ in range(500)])
    probes = [k for k, owner in owners.items() if owner == replica][:4]
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=120) as http:
        while True:
            results = [chat(base, "hi", prefix_hash=k, client=http) for k in probes * 2]
            assert all(r.status == 200 for r in results)
            if len({r.ingress for r in results}) == NUM_INGRESS and {r.replica for r in results} == {replica}:
                break
            assert time.monotonic() < deadline, "the routers did not route the replica's keys back to it"
            time.sleep(0.5)
    # The dropped stream is routine: the replicas' logs hold no traceback for it.
    assert not [line for line in new_serve_log_lines(before) if "Traceback" in line]


def test_distinct_prompts_spread_over_the_replicas_by_the_ring(base):
    rng = random.Random(102)
    systems = [f"Tenant {i}: " + words(rng, 20) for i in range(24)]
    owners = key_owner([prefix_hash(s) for s in systems])
    served = {}
    with httpx.Client(timeout=120) as http:
        for system in systems:
            r = chat(base, "hello", system=system, client=http)
            assert r.status == 200, r.body
            served[prefix_hash(system)] = r.replica
    assert served == owners
    assert len(set(served.values())) >= 2


def test_two_ingress_replicas_route_each_key_identically(base):
    rng = random.Random(103)
    keys = [f"{rng.getrandbits(64):016x}" for _ in range(4)]
    owners = key_owner(keys)
    seen: dict[str, set[tuple[str, str]]] = {k: set() for k in keys}
    with httpx.Client(timeout=120) as http:
        for _ in range(10):
            for k in keys:
                r = chat(base, words(rng, 4), prefix_hash=k, client=http)
                assert r.status == 200, r.body
                seen[k].add((r.ingress, r.replica))
    ingresses = {ingress for pairs in seen.values() for ingress, _ in pairs}
    assert len(ingresses) == NUM_INGRESS  # the proxy spread the requests over both ingress replicas
    for k in keys:
        assert {replica for _, replica in seen[k]} == {owners[k]}


# Long answers keep the victim's two seats busy, so that the rest still queue when it dies: a plain
# greedy stream, and one under a JSON schema (60 digits: some 300 tokens, whitespace included, from
# the tiny random model) the continuation's grammar must replay.
PLAIN_BODY = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 400, "ignore_eos": True}
LIST_SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 60,
    "maxItems": 60,
}
JSON_BODY = {
    "messages": [{"role": "user", "content": "list"}],
    "max_tokens": 900,
    "response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": LIST_SCHEMA}},
}


async def _stream(http: httpx.AsyncClient, base: str, key: str, record: dict) -> None:
    body = {**(JSON_BODY if record.get("json") else PLAIN_BODY), "temperature": 0, "stream": True}
    text: list[str] = []
    try:
        async with http.stream(
            "POST", f"{base}/v1/chat/completions", json=body, headers={PREFIX_HASH_HEADER: key}
        ) as response:
            record["status"] = response.status_code
            record["replica"] = response.headers.get(REPLICA_HEADER)
            record["attempts"] = int(response.headers.get(ATTEMPTS_HEADER, "0"))
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    record["done"], record["done_at"] = True, time.monotonic()
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        record["error"] = line
                        continue
                    piece = (event["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                    if piece:
                        record.setdefault("first_token_at", time.monotonic())
                        text.append(piece)
                    if event["choices"] and event["choices"][0].get("finish_reason"):
                        record["finish_reason"] = event["choices"][0]["finish_reason"]
    except httpx.HTTPError as exc:
        record["error"] = repr(exc)
    record["text"] = "".join(text)


async def _victim_waiting(http: httpx.AsyncClient, base: str, victim: str) -> bool:
    """Whether ``victim``'s engine reports a request waiting, from the ingress's gathered /metrics."""
    response = await http.get(f"{base}/metrics")
    try:
        return response.status_code == 200 and metric(response.text, "vllm:num_requests_waiting", replica=victim) >= 1
    except KeyError:  # the victim's text did not come back within the ingress's fan-out timeout
        return False


def migrations(metrics_text: str) -> dict[tuple[str, str], float]:
    """prefixserve_router_stream_migrations_total summed over ingress replicas, by (reason, result)."""
    out: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "prefixserve_router_stream_migrations_total":
                out[(s.labels["reason"], s.labels["result"])] += s.value
    return dict(out)


def test_killing_a_replica_mid_stream_loses_no_request_and_its_replacement_gets_its_keys_back(base):
    """Requests queued on the killed replica are resent; those it was streaming continue on another
    replica token for token (greedy: every plain answer equals every other, every JSON answer too,
    and parses and validates), whichever replica finished them."""
    import jsonschema
    import ray

    rng = random.Random(104)
    before = engine_replicas()
    ring = HashRing(before)
    victim = before[0]
    victim_actor = engine_actors()[victim]
    probe_keys = [f"{rng.getrandbits(64):016x}" for _ in range(2000)]
    victim_keys = [k for k in probe_keys if ring.owner(k) == victim][:8]
    other_keys = [k for k in probe_keys if ring.owner(k) != victim][:4]
    # Most of the victim's streams are JSON, so that one is mid-way when it dies (a grammar's replay).
    kinds = [True] * 6 + [False] * 2 + [True, False] * 2
    records = [{"key": k, "json": j} for k, j in zip(victim_keys + other_keys, kinds, strict=True)]
    with httpx.Client(timeout=120) as http:
        # The schema's grammar compiled on the victim beforehand: its JSON streams start as fast as the plain.
        warm = http.post(
            f"{base}/v1/chat/completions",
            json={**JSON_BODY, "temperature": 0},
            headers={PREFIX_HASH_HEADER: victim_keys[0]},
        )
        assert warm.status_code == 200 and warm.headers[REPLICA_HEADER] == victim, warm.text
        moved_before = migrations(http.get(f"{base}/metrics").text)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            tasks = [asyncio.create_task(_stream(http, base, r["key"], r)) for r in records]
            # Let the victim start its requests (max_num_seqs=2) and queue the rest: kill it only once a
            # JSON stream streams there and its engine reports a request waiting, so one is queued.
            deadline = time.monotonic() + 60
            json_on_victim = [r for r in records[: len(victim_keys)] if r["json"]]
            while not (
                any("first_token_at" in r for r in json_on_victim) and await _victim_waiting(http, base, victim)
            ):
                assert time.monotonic() < deadline, "the victim never streamed with a request queued"
                await asyncio.sleep(0.05)
            killed_at.append(time.monotonic())
            ray.kill(ray.get_actor(victim_actor, namespace="serve"), no_restart=True)
            await asyncio.gather(*tasks)

    killed_at: list[float] = []
    asyncio.run(main())
    failed = [r for r in records if not r.get("done") or "error" in r]
    assert not failed, failed
    resent = [r for r in records if r.get("attempts", 0) > 1]
    assert resent, "no request was queued on the victim when it died"
    assert all(r["replica"] != victim for r in resent)
    with httpx.Client(timeout=60) as http:
        moved = migrations(http.get(f"{base}/metrics").text)
    migrated = moved.get(("replica_died", "migrated"), 0) - moved_before.get(("replica_died", "migrated"), 0)
    # A streamed answer names its replica once the first token is here: the victim's streams not
    # done when it died moved.
    streaming_on_victim = [r for r in records if r["replica"] == victim and r["done_at"] > killed_at[0]]
    assert streaming_on_victim and migrated >= len(streaming_on_victim), (moved, streaming_on_victim)
    assert any(r["json"] for r in streaming_on_victim), "no JSON stream was on the victim when it died"
    for kind in (False, True):
        texts = {r["text"] for r in records if r["json"] is kind}
        assert len(texts) == 1, f"{'json' if kind else 'plain'} answers differ: {[t[:80] for t in texts]}"
    assert next(r["text"] for r in records if r["json"]) == warm.json()["choices"][0]["message"]["content"]
    numbers = json.loads(next(r["text"] for r in records if r["json"]))
    jsonschema.validate(numbers, LIST_SCHEMA)
    assert {r["finish_reason"] for r in records if r["json"]} == {"stop"}

    # Serve replaces the dead replica with one of the victim's rank: it takes the victim's
    # ring name, so every key, the victim's included, routes as before the kill.
    after = wait_for_replicas(3)
    wait_for_ring(base, after, NUM_INGRESS)
    actors = engine_actors()
    assert after == before and actors[victim] != victim_actor
    # As with an added replica, the newcomer may answer Serve's first queue-length probes
    # slowly (the base router then tries the next tier): every key must land on its owner
    # in one full round within a short settling period.
    deadline = time.monotonic() + 90
    with httpx.Client(timeout=120) as http:
        while True:
            results = [(k, chat(base, "where", prefix_hash=k, client=http)) for k in victim_keys + other_keys]
            assert all(r.status == 200 for _, r in results)
            strays = [(r.replica, ring.owner(k)) for k, r in results if r.replica != ring.owner(k)]
            if not strays:
                break
            assert time.monotonic() < deadline, f"keys not back on their owner: {strays[:3]}"
            time.sleep(1.0)


def test_adding_a_replica_moves_at_most_its_share_of_keys(base, ckpt):
    rng = random.Random(105)
    before = wait_for_replicas(3)
    # Scale through Serve's override (the args are unchanged, so no replica restarts).
    deploy(app_args(ckpt, 3), PORT, deployments=[{"name": "Engine", "num_replicas": 4}])
    after = wait_for_replicas(4)
    wait_for_ring(base, after, NUM_INGRESS)
    (newcomer,) = set(after) - set(before)
    keys = [f"{rng.getrandbits(64):016x}" for _ in range(10_000)]
    old_ring, new_ring = HashRing(before), HashRing(after)
    moved = [k for k in keys if old_ring.owner(k) != new_ring.owner(k)]
    assert all(new_ring.owner(k) == newcomer for k in moved)
    assert len(moved) / len(keys) <= 1 / 4 + 0.05
    # The routers see the new membership: live requests follow the new ring. The
    # newcomer may still be answering Serve's first queue-length probes slowly (then
    # the base router tries the next tier), so allow a short settling period: every
    # key must land on its new owner in one full round.
    logs_before = {path: len(lines) for path, lines in serve_log_lines("Ingress").items()}
    deadline = time.monotonic() + 90
    with httpx.Client(timeout=120) as http:
        while True:
            results = [(k, chat(base, "hi", prefix_hash=k, client=http)) for k in keys[:24]]
            assert all(r.status == 200 for _, r in results)
            strays = [(r.replica, new_ring.owner(k)) for k, r in results if r.replica != new_ring.owner(k)]
            if not strays:
                break
            if time.monotonic() > deadline:
                # What tells a router's choice from Serve's: the routers' decision kinds
                # (fallback: Serve moved the request off the replica ranked first) and the
                # ingress replicas' warnings of queue-length probes that missed their deadline.
                kinds = decision_kinds(http.get(f"{base}/metrics").text)
                probes = [line for line in new_serve_log_lines(logs_before) if "Failed to get queue length" in line]
                pytest.fail(
                    f"keys still off their new ring owner: {strays[:3]} of {len(strays)}; "
                    f"decisions (replica, kind): {kinds}; missed probes: {len(probes)} {probes[-2:]}"
                )
            time.sleep(1.0)
        metrics = http.get(f"{base}/metrics").text
    sizes = [
        s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "prefixserve_router_ring_size" and s.labels["deployment"] == "Engine"
    ]
    assert sizes == [4.0] * NUM_INGRESS


def test_placed_ingress_replicas_agree_on_placements_and_hear_kv_events(base, ckpt, tmp_path):
    """The default policy with two ingress replicas: one leader's placement table, applied by the other
    (both answer /placement with the same table, which counts the keys either routed and none of the
    requests the engines refused), and every router learns from the engines' KV events which replica
    holds each key's prefix."""
    args = app_args(ckpt, 3)
    args["router"] = {"policy": "placed", "precise": True, "rebalance_interval_s": 1.0, "stats_period_s": 0.5}
    args["ingress"] = {**args["ingress"], "placement_sync_s": 0.5}
    url = deploy(args, PORT)
    names = wait_for_replicas(3)
    wait_for_ring(url, names, NUM_INGRESS)
    rng = random.Random(107)
    systems = [f"Tenant {i}: " + words(rng, 60) for i in range(6)]
    keys = {prefix_hash(s) for s in systems}
    served: dict[str, set[str]] = {k: set() for k in keys}
    ingresses = set()
    with httpx.Client(timeout=120) as http:
        # Requests their engine replica refuses (prompts longer than max_model_len): routed and
        # counted, then taken back, so their keys never show in any table (checked below).
        for i in range(4):
            r = chat(url, words(rng, 4), system=f"Refused {i}: " + words(rng, 1500), client=http)
            assert r.status == 400 and r.body["error"]["code"] == "context_length_exceeded", r.body
        for i in range(36):  # tenant 0 every other request, the others in turn
            system = systems[0] if i % 2 == 0 else systems[1 + (i // 2) % 5]
            r = chat(url, words(rng, 4), system=system, client=http)
            assert r.status == 200, r.body
            served[prefix_hash(system)].add(r.replica)
            ingresses.add(r.ingress)
        assert len(ingresses) == NUM_INGRESS
        deadline = time.monotonic() + 90
        while True:
            snaps = {}
            for _ in range(16):
                response = http.get(f"{url}/placement")
                assert response.status_code == 200, response.text
                snaps[response.headers[INGRESS_HEADER]] = (
                    response.json(),
                    response.headers.get("X-Prefixserve-Placement-Leader"),
                )
            tables = [{k: v["replicas"] for k, v in snap["keys"].items()} for snap, _ in snaps.values()]
            versions = {snap["version"] for snap, _ in snaps.values()}
            leaders = {leader for _, leader in snaps.values()}
            helds = [{k: set(v) for k, v in snap["held"].items()} for snap, _ in snaps.values()]
            agreed = (
                len(snaps) == NUM_INGRESS
                and len(versions) == 1
                and tables[0] == tables[1]
                and set(tables[0]) == keys
                and len(leaders) == 1
                and leaders <= set(snaps)
            )
            heard = all(all(held.get(k) == served[k] for k in keys) for held in helds)
            if agreed and heard:
                break
            assert time.monotonic() < deadline, (versions, leaders, tables, helds, served)
            time.sleep(0.5)
    if find_prometheus() is None:
        return
    # placed's conversation panels on a real Prometheus: conversations keep flowing while it scrapes.
    stop = threading.Event()
    statuses: list[int] = []

    def load() -> None:
        with httpx.Client(timeout=120) as http:
            history: list[dict[str, str]] = []
            while not stop.is_set():
                history.append({"role": "user", "content": words(rng, 4)})
                r = http.post(
                    f"{url}/v1/chat/completions",
                    json={
                        "messages": [{"role": "system", "content": systems[0]}, *history[-6:]],
                        "max_tokens": 2,
                        "temperature": 0.0,
                    },
                )
                statuses.append(r.status_code)
                if r.status_code == 200:
                    history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
                stop.wait(0.3)

    with PrometheusProcess([url.removeprefix("http://")], tmp_path, scrape_interval_s=3) as prometheus:
        prometheus.wait_until(prometheus.targets_up, 60.0, "the ingress was not scraped")
        sender = threading.Thread(target=load, daemon=True)
        sender.start()
        try:
            prometheus.evaluate([q for q in dashboard_queries() if q.needs_placed], timeout_s=90.0)
        finally:
            stop.set()
            sender.join(timeout=130)
    assert statuses and set(statuses) == {200}, statuses


def test_ray_serve_llm_prefix_router_runs_on_the_engine_deployment(base, ckpt):
    """Ray Serve LLM's PrefixCacheAffinityRouter reads EngineRequest.messages and routes a repeated prompt home."""
    args = app_args(ckpt, 2)
    args["router"] = {"router_class": "ray_llm_prefix_aware"}
    deploy(args, PORT)
    wait_for_replicas(2)
    rng = random.Random(106)
    system = "Ray prefix tree tenant. " + words(rng, 60)
    results = [chat(base, "same question", system=system) for _ in range(4)]
    assert all(r.status == 200 for r in results), [r.body for r in results]
    assert len({r.replica for r in results[1:]}) == 1
    assert all(r.cached_tokens >= 48 for r in results[2:])


FLOW_TENANTS = {
    "tenants": [
        {"name": "live", "api_key": "k-live"},
        {"name": "batch", "api_key": "k-batch", "priorities": [10, 10]},
        {"name": "noisy", "api_key": "k-noisy", "requests_per_minute": 0.06},  # two banked, the next in 1,000 s
    ]
}


def test_flow_control_at_the_ingress_names_tenants_holds_quotas_and_queues_for_slots(cluster, ckpt, tmp_path):
    """Tenants at the Ray ingress: unknown keys refused, a tenant over its quota gets a 429 with the
    bucket's Retry-After, and past the one slot requests wait in the fair queue and all succeed; the
    flow-control panels show on a real Prometheus."""
    args = app_args(ckpt, 1)
    args["ingress"] = {**args["ingress"], "num_replicas": 1, "tenants": FLOW_TENANTS, "flow_max_in_flight": 1}
    url = deploy(args, PORT, api_key="k-live")
    wait_for_ring(url, wait_for_replicas(1), 1)
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "temperature": 0}

    def post(http: httpx.Client, key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        return http.post(f"{url}/v1/chat/completions", json=body, headers=headers)

    with httpx.Client(timeout=120) as http:
        assert post(http, None).status_code == 401
        assert post(http, "k-other").status_code == 401
        for _ in range(2):  # its two banked requests
            assert post(http, "k-noisy").status_code == 200
        over = post(http, "k-noisy")
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "tenant_rate_limit_exceeded"
        assert over.headers["X-Prefixserve-Reject-Reason"] == "requests_per_minute"
        assert int(over.headers["Retry-After"]) >= 1

    stop = threading.Event()
    statuses: list[int] = []

    def load(key: str) -> None:  # three senders over one slot: the others wait in the queue
        with httpx.Client(timeout=120) as http:
            sent = 0
            while sent < 4 or not stop.wait(0.05):
                statuses.append(post(http, key).status_code)
                sent += 1

    senders = [threading.Thread(target=load, args=(k,), daemon=True) for k in ("k-live", "k-batch", "k-live")]
    for sender in senders:
        sender.start()
    try:
        with httpx.Client(timeout=120) as http:
            deadline = time.monotonic() + 120
            while True:
                text = http.get(f"{url}/metrics").text
                try:
                    waited = metric(text, "prefixserve_router_flow_queue_wait_seconds_count")
                    live = metric(text, "prefixserve_router_flow_tokens_total", tenant="live", kind="completion")
                    batch = metric(text, "prefixserve_router_flow_tokens_total", tenant="batch", kind="prompt")
                    fairness = metric(text, "prefixserve_router_flow_fairness_index")
                except KeyError:
                    waited = live = batch = fairness = 0.0
                if waited >= 1 and live > 0 and batch > 0:
                    break
                assert time.monotonic() < deadline, text[-3000:]
                time.sleep(0.5)
        assert 0 < fairness <= 1
        assert (
            metric(text, "prefixserve_router_flow_rejections_total", tenant="noisy", reason="requests_per_minute") == 1
        )
        if find_prometheus() is not None:
            with PrometheusProcess([url.removeprefix("http://")], tmp_path, scrape_interval_s=3) as prometheus:
                prometheus.wait_until(prometheus.targets_up, 60.0, "the ingress was not scraped")
                prometheus.evaluate([q for q in dashboard_queries() if q.needs_flow], timeout_s=90.0)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=130)
    assert statuses and set(statuses) == {200}, statuses


def test_lora_adapters_through_the_cluster_get_their_own_key_and_tokens(cluster, ckpt, tmp_path):
    """A served adapter through the Ray path: listed with its parent, picked by ``model``, answered with
    the adapter's tokens, and routed by the adapter's own key (docs/routing.md rule 7)."""
    from lora_helpers import ALL_MODULES, make_adapter

    from prefixserve import LLM, LoRARequest, SamplingParams
    from prefixserve.router.routing_key import adapter_key

    adapter = make_adapter(ckpt, tmp_path / "all", targets=ALL_MODULES, rank=8, seed=11)
    args = app_args(ckpt, 2)
    args["engine"] = {**args["engine"], "enable_lora": True, "max_lora_rank": 8, "lora_modules": [f"all={adapter}"]}
    args["router"] = {"policy": "consistent_hash", "stats_period_s": 1.0}
    args["ingress"] = {**args["ingress"], "num_replicas": 1}
    url = deploy(args, PORT)
    names = wait_for_replicas(2)
    wait_for_ring(url, names, 1)
    ring = HashRing(names)
    system = next(
        s
        for s in (f"Adapter tenant {i}." for i in range(10_000))
        if ring.owner(prefix_hash(s)) != ring.owner(adapter_key(prefix_hash(s), "all"))
    )
    prompt = [5, 9, 14, 23, 42, 77, 101, 130, 7, 8, 9, 10]
    with httpx.Client(timeout=120) as http:
        # The ingress asks the engines again every few seconds: the replicas of the app this one
        # replaced may have answered its first question while they stopped.
        deadline = time.monotonic() + 60
        while True:
            models = http.get(f"{url}/v1/models").json()["data"]
            if any(m["id"] == "all" for m in models):
                break
            assert time.monotonic() < deadline, models
            time.sleep(0.5)
        base_name = models[0]["id"]
        assert {"id": "all", "parent": base_name}.items() <= next(m for m in models if m["id"] == "all").items()
        done = http.post(
            f"{url}/v1/completions", json={"model": "all", "prompt": prompt, "max_tokens": 6, "temperature": 0}
        )
        assert done.status_code == 200, done.text
        assert done.json()["model"] == "all"
        routed = {}
        for model in (base_name, "all"):
            r = http.post(
                f"{url}/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "temperature": 0,
                },
            )
            assert r.status_code == 200, r.text
            routed[model] = r.headers[REPLICA_HEADER]
    assert routed[base_name] == ring.owner(prefix_hash(system))
    assert routed["all"] == ring.owner(adapter_key(prefix_hash(system), "all"))
    # Every replica loaded the adapter at start and says so to the routers (placed prefers them).
    from ray import serve

    stats = serve.get_deployment_handle("Engine", app_name="prefixserve").broadcast("record_routing_stats")
    assert all(s.get("lora_adapters") == ["all"] and s["lora_capacity"] >= 1 for s in stats.results(timeout_s=60))
    llm = LLM(ckpt, enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    offline = llm.generate([prompt], greedy, lora_request=LoRARequest("all", 1, adapter))[0].outputs[0]
    assert done.json()["choices"][0]["text"] == offline.text


def test_two_base_models_behind_one_endpoint_each_on_its_own_engines(cluster, ckpt, gqa_ckpt):
    """``models``: a second base model gets its own engine deployment (and ring); the ingress sends each
    request to the model it names, lists both, and refuses a name neither serves with a 404."""
    from prefixserve import LLM, SamplingParams

    args = app_args(ckpt, 1)
    args["engine"] = {**args["engine"], "served_model_name": "first"}
    args["models"] = [{**args["engine"], "model": gqa_ckpt, "served_model_name": "second", "num_replicas": 1}]
    args["router"] = {"policy": "placed", "stats_period_s": 1.0}
    args["ingress"] = {**args["ingress"], "num_replicas": 1}
    url = deploy(args, PORT)
    prompt = [5, 9, 14, 23, 42, 77, 101, 130, 7, 8, 9, 10]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    with httpx.Client(timeout=120) as http:
        deadline = time.monotonic() + 120
        while True:
            listed = http.get(f"{url}/v1/models")
            ids = [m["id"] for m in listed.json().get("data", [])] if listed.status_code == 200 else []
            if ids == ["first", "second"]:
                break
            assert time.monotonic() < deadline, listed.text
            time.sleep(0.5)
        for model, path, deployment in (("first", ckpt, "Engine"), ("second", gqa_ckpt, "Engine-2")):
            done = http.post(
                f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            )
            assert done.status_code == 200, done.text
            assert done.json()["model"] == model
            assert f"#{deployment}#" in done.headers[REPLICA_HEADER]
            offline = LLM(path, num_kv_blocks=64).generate([prompt], greedy)[0].outputs[0]
            assert done.json()["choices"][0]["text"] == offline.text
        unknown = http.post(f"{url}/v1/completions", json={"model": "third", "prompt": prompt, "max_tokens": 2})
        assert unknown.status_code == 404, unknown.text
        assert "'first'" in unknown.text and "'second'" in unknown.text
        # Each model's placement is its own ring's.
        placement = http.get(f"{url}/placement", params={"model": "second"})
        assert placement.status_code == 200, placement.text
        assert all("#Engine-2#" in m for m in placement.json()["members"])
        assert http.get(f"{url}/placement", params={"model": "third"}).status_code == 404
        text = http.get(f"{url}/metrics").text
        assert "#Engine#" in text and "#Engine-2#" in text
        assert http.get(f"{url}/health").status_code == 200
