"""A tensor-parallel engine replica on a real Ray cluster, behind the prefixserve router and ingress.

One ``ray.cluster_utils.Cluster`` per module: a CPU-less head and one worker
node with 2 CPUs and no GPU. Tests run in file order:

1. The shipped cluster.yaml (TP 4 on GPUs) sent as ``serve deploy`` sends it:
   the app builds up to reserving its GPUs and Serve reports the missing
   resources as the app's one-line status message, not a traceback.
2. One engine replica with tensor_parallel_size 2 on CPU (gloo), its two ranks
   in a STRICT_PACK placement group of two bundles, answers chat completions
   over real HTTP with the same greedy text as an in-process TP 1 ``LLM`` on the
   same checkpoint, and leaves no process behind after Serve shuts down.

Deploying (2) replaces the whole Serve config, which removes the failed app of (1).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml
from cluster_helpers import (
    chat,
    cluster_fixture,
    deploy,
    deploy_config,
    replica_processes,
    submit_config,
    wait_for_app_status,
    wait_for_replicas,
)

pytestmark = pytest.mark.slow

PORT = 18471
CLUSTER_YAML = Path(__file__).resolve().parents[3] / "cluster.yaml"
TP = 2
MAX_TOKENS = 8
PROMPTS = ["Tell me about rivers.", "alpha beta gamma delta", "What is the capital of a garden?"]


def app_args(model: str) -> dict:
    return {
        "engine": {
            "model": model,
            "tensor_parallel_size": TP,
            "device": "cpu",
            "num_kv_blocks": 256,
            "max_num_seqs": 2,
            "max_model_len": 512,
        },
        "num_replicas": 1,
        # One rank's resources: the replica reserves TP bundles of them on one node.
        "ray_actor_options": {"num_cpus": 0.5},
        "health_check_period_s": 1.0,
        "router": {"policy": "bounded_load", "epsilon": 1.0, "stats_period_s": 1.0},
        # A sliver of CPU keeps the ingress off the CPU-less head node (see tests/router/serve/test_cluster.py).
        "ingress": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}},
    }


cluster = cluster_fixture(num_workers=1)


@pytest.fixture(scope="module")
def base(cluster, ckpt) -> str:
    url = deploy(app_args(ckpt), PORT, timeout_s=300)
    wait_for_replicas(1)
    return url


def test_shipped_cluster_yaml_fails_in_serve_status_naming_the_missing_gpus(cluster):
    shipped = yaml.safe_load(CLUSTER_YAML.read_text())
    (app,) = copy.deepcopy(shipped["applications"])
    app["name"] = "shipped"
    # The shipped file as is, but on this cluster's one proxy and port.
    config = {**shipped, **deploy_config({}, PORT), "applications": [app]}
    submit_config(config)
    status = wait_for_app_status("shipped", {"DEPLOY_FAILED", "RUNNING"})
    assert status.status == "DEPLOY_FAILED"
    assert status.message == (
        "Deploying app 'shipped' failed with exception:\n"
        "tensor_parallel_size=4 needs 4 bundles {'CPU': 2, 'GPU': 1} on one node (STRICT_PACK), CPU 8, GPU 4 "
        "together: no node has them; the most any of the 2 alive nodes has is CPU 2, GPU 0. Add such a node, "
        "lower tensor_parallel_size or ray_actor_options (one rank's resources), or set check_resources: false "
        "if the autoscaler adds such nodes on demand"
    )


def test_tp2_cpu_replica_answers_through_the_router_like_tp1(base, ckpt):
    from prefixserve.replica.entrypoints.llm import LLM
    from prefixserve.replica.sampling_params import SamplingParams

    results = [chat(base, prompt, max_tokens=MAX_TOKENS) for prompt in PROMPTS]
    assert all(r.status == 200 for r in results), [r.body for r in results]
    assert len({r.replica for r in results}) == 1
    served = [r.body["choices"][0]["message"]["content"] for r in results]

    with LLM(ckpt, num_kv_blocks=256, max_num_seqs=2, max_model_len=512, device="cpu") as llm:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        )
    assert served == [o.outputs[0].text for o in outputs]
    assert [r.body["usage"]["completion_tokens"] for r in results] == [len(o.outputs[0].token_ids) for o in outputs]


def test_tp_replica_reserves_one_bundle_per_rank_and_leaves_no_process_after_shutdown(cluster, base):
    from ray import serve
    from ray.util.placement_group import placement_group_table

    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    assert [(g["strategy"], list(g["bundles"].values())) for g in groups] == [("STRICT_PACK", [{"CPU": 0.5}] * TP)]

    (replica,) = replica_processes(cluster)
    children = replica.children(recursive=True)
    # Rank 0 is the replica itself; ranks 1..TP-1 are processes it spawned (multiprocessing's
    # spawn_main; its resource tracker, if any, is another child and must go too).
    workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    assert len(workers) == TP - 1, [c.cmdline() for c in children]

    titles = {p.pid: " ".join(p.cmdline()) for p in (replica, *children)}
    assert all(alive(p) for p in (replica, *children)), titles
    serve.shutdown()
    leftover = [replica, *children]
    deadline = time.monotonic() + 120
    while leftover and time.monotonic() < deadline:
        leftover = [p for p in leftover if alive(p)]
        time.sleep(0.5)
    assert not leftover, [(p.pid, titles[p.pid]) for p in leftover]


def alive(process) -> bool:
    """Still running (a zombie has exited; psutil's Process also checks the pid was not reused)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
