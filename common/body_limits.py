"""The request-body bounds of the OpenAI front end: what a host accepts before parsing a request.

Defaults of the front end's options (replica/entrypoints/openai/http_frontend.py) that the
cluster's config (router/cluster_config.py) and the standalone server's flags repeat, kept
here so that the router's config reads them without loading the front end. Pure stdlib.
"""

from __future__ import annotations

# Larger request bodies get 413.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Seconds a client may take to send a whole request body (nginx's client_body_timeout, 60 s, bounds the
# gap between two reads; a bound on the whole body also stops a client that trickles a byte at a time).
DEFAULT_CLIENT_BODY_TIMEOUT_S = 60.0
