"""The pieces every benchmark in loadtest/ shares, one module a job.

* :mod:`.cli`: the ``main`` of a benchmark that plans its run before it starts it.
* :mod:`.client`: the closed-loop streaming client and its per-request records (TTFT, usage, replica).
* :mod:`.sse`: the OpenAI streaming response read as events.
* :mod:`.stats`: percentiles and the mean/p50/p99 summary.
* :mod:`.report`: number formatting for the markdown tables, the JSON result file.
* :mod:`.plotting`: one matplotlib figure written to a PNG.
* :mod:`.server`: the server under test as a child process (port, start, readiness, stop).
"""
