"""The ``prefixserve`` command.

Each subcommand lives in the module that owns its job; this file only wires
them. A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``
and is imported lazily, so ``prefixserve route`` does not pay for torch or Ray.
What the subcommands share (argument checkers, output, exit statuses) is
cli/common.py, which the subcommand modules import without this one.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "replica": ("prefixserve.replica.entrypoints.openai.server", "run one engine replica as an OpenAI HTTP server"),
    "up": (
        "prefixserve.router.cli.up",
        "run the cluster on this machine: local Ray, replicas, router, OpenAI endpoint",
    ),
    "router": (
        "prefixserve.router.standalone.cli",
        "run the standalone router (no Ray) in front of OpenAI-compatible replicas (prefixserve, vLLM, SGLang)",
    ),
    "route": ("prefixserve.router.cli.route", "print the routing key of a prompt and the replica the ring picks"),
    "nginx-config": (
        "prefixserve.router.nginx.config",
        "render an nginx.conf hash-consistent upstream for a replica list",
    ),
    "placement": (
        "prefixserve.router.nginx.placement",
        "replay nginx's routing-key log through the placed policy: a placement for nginx-config",
    ),
    "audit": ("prefixserve.loadtest.prompt_audit", "audit a prompt log for prefix-cache hit-rate killers"),
}

# Environment a subcommand's process starts with unless the user set it (or one of the variables
# that would stand in its stead: a wait policy decides the spin as well), applied before its module
# (and so torch and libgomp) is imported. A replica's forward starts hundreds of OpenMP regions a
# step from one thread; libgomp's default spin between them (300,000 pauses, milliseconds) wins on
# an idle machine and collapses when another process wants the cores, where its workers spin on
# cores the engine thread needs. 10,000: served on 2 cores (docs/benchmarks/layers.md) 13.6 s
# idle against 12.9 s at the default, and 28.9 s beside a busy process against 82.8 s.
ENVIRONMENT_DEFAULTS: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "replica": (("GOMP_SPINCOUNT", "10000", ("OMP_WAIT_POLICY",)),),
}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (2 for a bad command line, with argparse's message)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="prefixserve", description="Prefix-aware LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        if argv[:1] == [name]:
            for key, value, unless in ENVIRONMENT_DEFAULTS.get(name, ()):
                if key not in os.environ and not any(other in os.environ for other in unless):
                    os.environ[key] = value
            importlib.import_module(module_name).add_arguments(sub_parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (2, message printed) and --help (0): a status like run's
        return exc.code if isinstance(exc.code, int) else 2
    return int(importlib.import_module(args._module).run(args) or 0)
