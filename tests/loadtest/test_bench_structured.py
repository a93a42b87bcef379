"""bench_structured's measure on a tiny random checkpoint (no assertion about speed), and its
vLLM peer scripts' isolation (they run in vLLM's own venv, which CI does not build: this one's and
bench_lora's)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from model_helpers import tiny_checkpoint

from prefixserve.loadtest import bench_structured as B
from prefixserve.loadtest.peers import vllm_lora, vllm_structured
from prefixserve.replica.entrypoints.llm import LLM


@pytest.mark.parametrize("peer", [vllm_structured, vllm_lora], ids=["structured", "lora"])
def test_the_peer_scripts_import_nothing_of_ours(peer):
    tree = ast.parse(Path(peer.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "vllm" in names and not any(m.startswith(("prefixserve", "loadtest", "replica")) for m in names), names


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(str(tiny_checkpoint(tmp_path_factory.mktemp("bs") / "tiny", seed=5)), max_num_seqs=4) as engine:
        yield engine


def test_a_pair_times_only_the_full_batch_decode_steps(llm):
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i, 500 + i] for i in range(3)]
    free, constrained = B.run_pair(llm, prompts, 6, "-t")
    for run in (free, constrained):
        # 6 tokens a request: the first comes with the prefill, the other 5 in 5 decode steps of all 3.
        assert len(run.step_s) == 5 and all(s > 0 for s in run.step_s)
        assert [len(o.outputs[0].token_ids) for o in run.outputs] == [6, 6, 6]
        assert run.tpot_s > 0 and run.mean_request_tpot_s > 0
    # The constrained run follows the schema: an array of records.
    assert constrained.outputs[0].outputs[0].text.lstrip().startswith("[")
    rows = B.tpot_rows({3: [(free, constrained)]})
    assert rows[0]["batch"] == 3 and rows[0]["ratio"] == pytest.approx(constrained.tpot_s / free.tpot_s)
