"""The standalone router: ``prefixserve router``, the policies of router/policies/ in front of any
OpenAI-compatible replicas over plain HTTP (no Ray, no Serve config).

config.py (settings), replica_set.py (health and load state), load_report.py (a replica's
``/metrics``), routing.py (the decision), usage.py (an answer's token usage), kv_events.py
(the replicas' KV events as the decision's inputs), prompt_tokens.py (a prompt's token ids,
for the KV events' block hashes), metrics.py (the router's own), proxy.py (the HTTP app),
cli.py (the subcommand). Every module but proxy.py, cli.py and prompt_tokens.py (it reads a
tokenizer folder) is pure.
"""
