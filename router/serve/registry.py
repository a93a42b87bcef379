"""The request routers running in this process, by (application, deployment).

Job: let the ingress (router/serve/ingress.py) reach the PrefixRouter that Ray Serve
built for its engine handle in the same process (placement exchange,
``/placement``, prefill work). Ray Serve ships a request router class to the
process by value (cloudpickle of its module, ray/serve/config.py
``_serialize_request_router_cls``), so module-level state in
router/serve/request_router.py is a private copy; this module is imported by
reference and is therefore the one shared table.

Pure Python: no Ray, no HTTP framework.
"""

from __future__ import annotations

from typing import Any

_ROUTERS: dict[tuple[str, str], Any] = {}


def register(app_name: str, deployment: str, router: Any) -> None:
    """Record ``router`` as this process's router of ``app_name``'s ``deployment`` (the latest wins)."""
    _ROUTERS[(app_name, deployment)] = router


def router_for(app_name: str, deployment: str) -> Any | None:
    """This process's router of ``app_name``'s ``deployment`` (None before the handle built it)."""
    return _ROUTERS.get((app_name, deployment))
