"""The ``prefixserve`` command.

Each subcommand lives in the module that owns its job; this file only wires
them. A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``
and is imported lazily, so ``prefixserve route`` does not pay for torch or Ray.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# Exit statuses shared by the subcommands, as linters use them: 0 all good; 2 bad
# input or command line (one error line, nothing written); EXIT_SKIPPED: the
# output was written, but some input records were skipped, each named by one
# line on stderr. (1: the output could not be written, see write_output.)
EXIT_SKIPPED = 3

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "replica": ("prefixserve.replica.entrypoints.openai.server", "run one engine replica as an OpenAI HTTP server"),
    "up": ("prefixserve.router.up", "run the cluster on this machine: local Ray, replicas, router, OpenAI endpoint"),
    "route": ("prefixserve.router.route_cli", "print the routing key of a prompt and the replica the ring picks"),
    "nginx-config": ("prefixserve.router.nginx", "render an nginx.conf hash-consistent upstream for a replica list"),
    "placement": (
        "prefixserve.router.nginx_placement",
        "replay nginx's routing-key log through the placed policy: a placement for nginx-config",
    ),
    "audit": ("prefixserve.router.audit", "audit a prompt log for prefix-cache hit-rate killers"),
}


def arg_type(check: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` from a checker that raises ValueError.

    argparse turns a plain ValueError into "invalid value"; this keeps the
    checker's message, so a bad flag exits with status 2 and one line saying why.
    """

    def convert(value: str) -> T:
        try:
            return check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(check, "__name__", "value")
    return convert


def write_output(prog: str, text: str, output: str | None) -> int:
    """Write a command's output to the ``output`` file, or stdout when None; its exit status.

    A file that cannot be written is one error line on stderr and status 1.
    """
    if not output:
        sys.stdout.write(text)
        return 0
    try:
        Path(output).write_text(text)
    except OSError as e:
        print(f"{prog}: error: cannot write {output}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (2 for a bad command line, with argparse's message)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="prefixserve", description="Prefix-aware LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        if argv[:1] == [name]:
            importlib.import_module(module_name).add_arguments(sub_parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (2, message printed) and --help (0): a status like run's
        return exc.code if isinstance(exc.code, int) else 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
