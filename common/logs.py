"""Output hygiene for the command-line tools and benchmarks.

Libraries log routine events at INFO: httpx one line per request (a benchmark sends
hundreds), Ray and Serve their deployment steps, transformers its loading notes.
Interleaved with progress bars and result tables they bury both. The tools call
:func:`quiet_libraries` once at start; ``--verbose`` (:func:`add_verbose_flag`)
keeps everything. Our own loggers (``prefixserve.*``) are left as configured.
"""

from __future__ import annotations

import argparse
import logging

# Loggers of libraries the tools drive; their INFO is noise to a user of the tools.
# "ray.serve" has its own level (Serve sets it), so it is named besides "ray".
LIBRARY_LOGGERS = (
    "httpx",
    "httpcore",
    "urllib3",
    "ray",
    "ray.serve",
    "filelock",
    "asyncio",
    "transformers",
    "huggingface_hub",
    "matplotlib",
    "PIL",
)


def add_verbose_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``-v/--verbose``: show libraries' INFO logs too."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also show libraries' INFO logs (httpx requests, Ray, transformers)",
    )


def quiet_libraries(verbose: bool = False) -> int:
    """Set the library loggers to WARNING unless ``verbose``; returns the level Ray's own
    logging should be initialised with (``ray.init(logging_level=...)``)."""
    level = logging.INFO if verbose else logging.WARNING
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    return level
