"""``prefixserve placement``: a ``placed`` placement for the nginx path, from nginx's routing-key log.

Job: nginx runs no prefixserve router, so nothing on that path keeps the
``placed`` policy's table. This command rebuilds it offline: it reads the log
``prefixserve nginx-config --key-log PATH`` makes nginx write (one JSON object
per request: ``msec``, the client's ``X-Prefix-Hash`` as ``key``, ``status``,
``upstream``; router/nginx/config.py KEY_LOG_FIELDS), replays every keyed request
through the real ``Placed`` policy (router/policies/placed.py) with its clock set to
the line's time, and writes the policy's ``placement_snapshot()`` JSON, whose
members are the nginx servers (``host:port``). ``prefixserve nginx-config
--placement FILE`` renders that snapshot as a map of salted keys; ``nginx -s
reload`` applies it.

What the replay can and cannot know:

* rates, hot-key replication and shedding are the live router's: the policy
  counts each request at its logged time and rebalances every
  ``rebalance_interval_s`` of log time (``rank`` does it when the clock passes
  the interval), plus once at the last line's time, so the snapshot covers the
  whole log;
* nginx has no per-request load to report, so every candidate has 0 requests in
  flight: the policy's in-flight cap never spills a request in the replay (on
  the live nginx path a replica's own ``--max-in-flight`` 429 and nginx's
  ``proxy_next_upstream`` do that);
* no prefill work (the log has no token counts): placement balances request
  rates only, as the policy does without ``observe``;
* ``$msec`` is when nginx wrote the line (the request's end) and workers' lines
  may interleave slightly out of order; the replay clock never goes back (a line
  older than the last one counts at the last one's time).

Rounds: each replay starts from an empty table unless ``--previous SNAPSHOT``
(the last round's output) seeds it, as a follower router applies its leader's
snapshot: placements and decayed statistics carry over, taken as of the log's
first line, so a rotated log replays into the placement nginx already has
instead of one rebuilt from scratch (which would move keys, each move a cold
prefill). Without it, replay the whole log each round.

Lines that are not such JSON objects (nested too deeply, a key that is not
Unicode text), or have no usable time, are skipped, each named by one line on
stderr (``LOG:LINE: reason``); requests without a key (``""``, or ``-`` from a
hand-written log) are counted and left out. One summary line on stderr reports
both. Exit status: 0; 3 (router/cli/'s EXIT_SKIPPED) when the snapshot was
written but lines were skipped; 2 for bad input (nothing written); 1 when the
output cannot be written. Time is linear in the log's length.

Pure Python + numpy (the placement table): must not import Ray, HTTP frameworks or torch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import IO, Any

from prefixserve.router.cli.common import EXIT_SKIPPED, arg_type, write_output
from prefixserve.router.nginx.config import add_replica_argument, check_output, load_placement
from prefixserve.router.policies import Placed, Replica, check_options, pick_options
from prefixserve.router.ring import HashRing, RingServer

PROG = "prefixserve placement"
# The placed knobs this command takes, as (flag, option name): the values are the policy's to check.
POLICY_FLAGS: tuple[tuple[str, str], ...] = (
    ("--epsilon", "epsilon"),
    ("--hot-share", "hot_share"),
    ("--tau-s", "tau_s"),
    ("--rebalance-interval-s", "rebalance_interval_s"),
    ("--noise-z", "noise_z"),
)
NO_KEY = ("", "-")


@dataclass
class ReplayCounts:
    """What a replay read: lines, requests replayed, lines skipped (by cause), the log's time span."""

    lines: int = 0
    requests: int = 0
    unparsed: int = 0
    no_key: int = 0
    first_s: float | None = None
    last_s: float | None = None

    def summary(self, snapshot: Mapping[str, Any] | None, servers: Sequence[RingServer]) -> str:
        """One line: what was replayed, what was skipped, and how the placement differs from the ring."""
        span = 0.0 if self.first_s is None or self.last_s is None else self.last_s - self.first_s
        text = (
            f"{PROG}: replayed {self.requests} requests over {span:.1f}s of log; skipped "
            f"{self.unparsed} unparsable lines and {self.no_key} requests without a key"
        )
        if snapshot is None:
            return text
        ring = HashRing(servers)
        keys = snapshot.get("keys", {})
        moved = sum(1 for k, e in keys.items() if e["replicas"] and e["replicas"][0] != ring.owner(k))
        copied = sum(1 for e in keys.values() if len(e["replicas"]) > 1)
        return f"{text}; {len(keys)} keys, {moved} placed off their ring owner, {copied} replicated"


def parse_key_line(line: str) -> tuple[float, str | None]:
    """``(time_s, key)`` of one key-log line; key None for a request without one. ValueError if unparsable."""
    try:
        record = json.loads(line)
    except ValueError:
        raise ValueError("not a JSON object") from None
    except RecursionError:  # the decoder recurses per nesting level
        raise ValueError("not a JSON object (nested too deeply)") from None
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    try:
        when = float(record["msec"])
    except (KeyError, TypeError, ValueError, OverflowError):
        raise ValueError("no msec time") from None
    if not math.isfinite(when) or when < 0:
        raise ValueError(f"msec {when!r} is not a time")
    key = record.get("key")
    if not isinstance(key, str):
        raise ValueError("no key field")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as e:  # a \u escape spelling a lone surrogate: no hash can encode it
        raise ValueError(f"the key holds a lone surrogate at character {e.start}: not Unicode text") from None
    return when, None if key in NO_KEY else key


def read_key_log(
    lines: Iterable[str], counts: ReplayCounts, on_skipped: Callable[[int, str], None] | None = None
) -> Iterator[tuple[float, str]]:
    """The keyed requests of a key log, in order, as ``(time_s, key)``; skipped lines are counted in ``counts``.

    ``on_skipped(line_number, reason)`` is called for each unparsable line (numbered from 1).
    """
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        counts.lines += 1
        try:
            when, key = parse_key_line(line)
        except ValueError as e:
            counts.unparsed += 1
            if on_skipped is not None:
                on_skipped(number, str(e))
            continue
        if key is None:
            counts.no_key += 1
            continue
        yield when, key


def placed_options(servers: Sequence[RingServer], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The ``placed`` options for a replay: the given knobs (None: the policy's default) and the ring weights.

    ValueError (the policy's own message) for a bad value or duplicate servers.
    """
    names = [s.name for s in servers]
    if not names:
        raise ValueError("give at least one --replica HOST:PORT")
    if len(set(names)) != len(names):
        raise ValueError(f"replica names must be unique, got {names}")
    options = pick_options(Placed.name, {**settings, "weights": {s.name: s.weight for s in servers}})
    check_options(Placed.name, **options)
    return options


def replay(
    entries: Iterable[tuple[float, str]],
    servers: Sequence[RingServer],
    options: Mapping[str, Any],
    counts: ReplayCounts,
    previous: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The placement snapshot after replaying ``entries`` through ``Placed`` (None when there were none).

    The candidates are the nginx servers, each with no request in flight (nginx
    reports none). ``previous``: a snapshot applied at the first entry's time
    (ValueError if it is not one). Ends with one rebalance at the last request's time.
    """
    now = [0.0]
    policy = Placed(**options, clock=lambda: now[0])
    candidates = [Replica(s.name) for s in servers]
    for when, key in entries:
        if counts.first_s is None:
            counts.first_s = now[0] = when
            if previous is not None:
                _apply_previous(policy, previous, servers)
        now[0] = max(now[0], when)  # the policy's clock is monotonic; nginx workers' lines may interleave
        policy.rank(candidates, key)
        counts.requests += 1
    counts.last_s = now[0] if counts.requests else None
    if not counts.requests:
        return None
    policy.rebalance()
    return policy.placement_snapshot()


def _apply_previous(policy: Placed, previous: Mapping[str, Any], servers: Sequence[RingServer]) -> None:
    """Seed ``policy`` with a previous round's snapshot; the --replica weights win over its own."""
    try:
        weights = {**(previous.get("weights") or {}), **{s.name: s.weight for s in servers}}
        policy.apply_snapshot({**previous, "weights": weights})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        why = f"no {e}" if isinstance(e, KeyError) else str(e) or type(e).__name__
        raise ValueError(f"--previous is not a placement snapshot: {why}") from None


def _open_log(source: str) -> AbstractContextManager[IO[str]]:
    """The log as text lines: stdin for ``-`` (left open), else the file."""
    if source == "-":
        return nullcontext(sys.stdin)
    # Header bytes that are not UTF-8 (nginx logs them raw) become U+FFFD: such keys are never mapped anyway.
    return open(source, encoding="utf-8", errors="replace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags: the log, the nginx servers as nginx-config takes them, the placed knobs, --output."""
    parser.add_argument("log", metavar="LOG", help="nginx's routing-key log (nginx-config --key-log), or - for stdin")
    add_replica_argument(parser, "an nginx upstream server, exactly as given to nginx-config; repeat for each")
    parser.add_argument(
        "--previous",
        default=None,
        metavar="FILE|URL",
        help="the last round's snapshot: start from its placements and statistics (then give "
        "only the log written since)",
    )
    for flag, option in POLICY_FLAGS:
        parser.add_argument(
            flag, dest=option, type=float, default=None, help=f"placed's {option} (default: the policy's)"
        )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        type=arg_type(check_output),
        help="write the snapshot here (its directory must exist) instead of stdout",
    )


def run(args: argparse.Namespace) -> int:
    """Replay the log and write the snapshot; 2 with one line on stderr for bad input, 1 if it cannot write,
    EXIT_SKIPPED (3) when it was written but lines were skipped (each named on stderr)."""
    servers: list[RingServer] = list(args.replica)
    counts = ReplayCounts()

    def skipped(number: int, reason: str) -> None:
        print(f"{PROG}: {args.log}:{number}: {reason} (skipped)", file=sys.stderr)

    try:
        options = placed_options(servers, {option: getattr(args, option) for _, option in POLICY_FLAGS})
        previous = None if args.previous is None else load_placement(args.previous)
        with _open_log(args.log) as stream:
            snapshot = replay(read_key_log(stream, counts, skipped), servers, options, counts, previous)
    except (OSError, UnicodeError) as e:
        print(f"{PROG}: error: cannot read {args.log}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if snapshot is None:
        print(
            f"{PROG}: error: no request with a key in {args.log} ({counts.lines} lines: {counts.unparsed} "
            f"unparsable, {counts.no_key} without a key); is it nginx-config --key-log's log?",
            file=sys.stderr,
        )
        return 2
    text = json.dumps(snapshot) + "\n"
    print(counts.summary(snapshot, servers), file=sys.stderr)
    status = write_output(PROG, text, args.output)
    return EXIT_SKIPPED if status == 0 and counts.unparsed else status
