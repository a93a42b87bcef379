"""The ingress<->engine contract: what crosses between a front end (or the router) and an engine replica.

``request``: the engine request, the model info, the engine client a front end talks to; ``routing``:
the headers and static roles the routing key reads; ``stream``: the items of a generate stream;
``finish_reason``: why a sequence stopped; ``kv_events``: the KV-event payloads a replica publishes and
a router consumes; ``tokenizer``: a model's tokenizer for tools that count tokens. router/ imports
replica/ through these, the request errors, the block hashing and the engine config only. Nothing here
loads the engine or the front ends (tests/test_import_rules.py).
"""
