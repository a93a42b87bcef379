"""Where prefixserve keeps what it builds or converts on this machine (C kernels, checkpoints)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The project's cache directory: ``$PREFIXSERVE_CACHE_DIR``, else ``~/.cache/prefixserve``."""
    return Path(os.environ.get("PREFIXSERVE_CACHE_DIR") or Path.home() / ".cache" / "prefixserve")
