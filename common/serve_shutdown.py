"""Stopping Ray Serve without the spurious "graceful_shutdown failed" warning.

``serve.shutdown()`` (Ray 2.x) waits on ``ServeController.graceful_shutdown(wait=True)``,
a task that by design only ends when the controller, having deleted every app and
proxy, kills itself: Ray then reports "Task ServeController.graceful_shutdown failed
... killed by ray.kill" on the driver's stderr, though nothing failed. Asking the
controller the same thing with ``wait=False`` and waiting for it to exit shuts Serve
down the same way with no failing task. That call is Serve's internal API, so when
it is missing (another Ray version) this falls back to ``serve.shutdown()``.

Call :func:`shutdown_serve` before ``ray.shutdown()``.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def shutdown_serve(timeout_s: float = 30.0) -> None:
    """Delete every Serve app and stop Serve's controller and proxies; returns once the
    controller is gone (or ``timeout_s`` passed). A no-op when Serve is not running."""
    import ray
    from ray import serve

    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
        from ray.serve.context import _disconnect, _get_global_client
        from ray.serve.exceptions import RayServeException
    except ImportError:
        serve.shutdown()
        return
    if not ray.is_initialized():
        return
    try:
        controller = _get_global_client()._controller
    except RayServeException:
        return  # Serve is not running
    except AttributeError:
        serve.shutdown()
        return
    ray.get(controller.graceful_shutdown.remote(wait=False))
    # Wait by name lookup (a GCS query), not by calling the controller: a call in flight
    # when it exits is another "failed task" warning.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            break
        time.sleep(0.1)
    else:
        log.warning("Serve's controller did not exit within %.0f s", timeout_s)
    _disconnect()
