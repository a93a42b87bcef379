"""The ``main`` of a benchmark that checks its whole plan before it starts anything."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TypeVar

from prefixserve.common.logs import quiet_libraries

P = TypeVar("P")


def plan_and_run(
    parser: argparse.ArgumentParser,
    plan: Callable[[argparse.Namespace], P],
    run: Callable[[argparse.Namespace, P], int],
    argv: Sequence[str] | None = None,
) -> int:
    """Parse ``argv``, build the plan and run it; returns the run's exit status.

    The parser has common/logs.py's ``--verbose`` (library logs stay quiet without it).
    A plan that raises ValueError is a usage error: argparse reports it and exits
    with status 2 before any cluster or server is started.
    """
    args = parser.parse_args(argv)
    quiet_libraries(args.verbose)
    try:
        p = plan(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2
    return run(args, p)
