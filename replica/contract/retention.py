"""OpenAI's ``prompt_cache_retention`` as the engine honours it, and the header that answers it.

``"in_memory"`` (OpenAI's default) is the prefix cache as it is. ``"24h"`` asks the replica to pin
the request's prefix blocks (replica/kv/pins.py) for the engine's ``cache_retention_ttl_s``,
refreshed by every hit, within its pin budget. The answer says in ``CACHE_RETENTION_HEADER``
whether the budget held them (``RETENTION_PINNED``) or the request was served unpinned
(``RETENTION_UNPINNED``, counted in ``prefixserve:kv_pin_refusals_total``). Constants only.
"""

from __future__ import annotations

RETENTION_IN_MEMORY = "in_memory"
RETENTION_24H = "24h"
PROMPT_CACHE_RETENTIONS = (RETENTION_IN_MEMORY, RETENTION_24H)

CACHE_RETENTION_HEADER = "X-Prefixserve-Cache-Retention"
RETENTION_PINNED = "pinned"
RETENTION_UNPINNED = "unpinned; reason=budget"
