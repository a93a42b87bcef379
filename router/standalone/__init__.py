"""The standalone router: ``prefixserve router``, the policies of router/policies/ in front of any
OpenAI-compatible replicas over plain HTTP (no Ray, no Serve config).

config.py (settings), replica_set.py (health and load state), load_report.py (a replica's
``/metrics``), routing.py (the decision), metrics.py (the router's own), proxy.py (the HTTP
app), cli.py (the subcommand). Every module but proxy.py and cli.py is pure.
"""
