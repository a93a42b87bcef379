"""The pieces every benchmark in loadtest/ shares, one module a job.

* :mod:`.cli`: the ``main`` of a benchmark that plans its run before it starts it. Flags
  generated from a config dataclass come from common/config_util.py's
  ``add_cli_arguments`` / ``from_cli_args`` (bench_serve, soak).
* :mod:`.client`: the closed-loop streaming client and its per-request records (TTFT, usage, replica).
* :mod:`.sse`: the OpenAI streaming response read as events.
* :mod:`.stats`: percentiles, the mean/p50/p99 summary, the median of repeated runs.
* :mod:`.report`: table cells and markdown tables, the JSON result file.
* :mod:`.plotting`: one matplotlib figure written to a PNG.
* :mod:`.server`: the server under test as a child process (port, start, readiness, stop).
"""
