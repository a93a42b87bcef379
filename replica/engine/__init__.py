"""The engine: the step loop, the asynchronous engine, the request runner, outputs, metrics and KV events."""
