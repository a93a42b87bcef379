"""What the ``prefixserve`` subcommands share: argument checkers, writing the output, exit statuses.

Imports nothing of ours: the subcommand modules anywhere in router/ (nginx/,
tools/) take these from here, never from the dispatcher in cli/__init__.py.
"""

from __future__ import annotations

import argparse
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
