"""``prefixserve route``: show where a prompt lands without sending it.

Job: compute a routing key (from ``--key``, or from ``--system`` text with
``--tools`` and ``--cache-salt``), then print its crc32, the replica the ring picks (as nginx
with the same ``server`` lines would) and the ring successors a request falls
back to. The key of ``--system`` is the one the router computes for a chat
whose system message is that text (router/routing_key.py's ``routing_key``): an empty
static prefix has no key, so no affinity (the policy routes such a request by
load), and the command says so. Pure: no network, no Ray.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from prefixserve.router.cli.common import arg_type
from prefixserve.router.ring import MAX_WEIGHT, HashRing, RingServer, key_hash
from prefixserve.router.routing_key import PREFIX_HASH_HEADER, routing_key, validate_prefix_hash


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica",
        action="append",
        required=True,
        type=arg_type(RingServer.parse),
        metavar="HOST:PORT[=WEIGHT]",
        help=f"a ring member, in nginx's `server` order (weight 1..{MAX_WEIGHT}); repeat for each replica",
    )
    parser.add_argument(
        "--down",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a listed replica that is unusable (keeps its ring points, is skipped)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--key", type=arg_type(validate_prefix_hash), help=f"a routing key as sent in {PREFIX_HASH_HEADER}"
    )
    source.add_argument("--system", help="the static prefix (system prompt) to hash")
    parser.add_argument(
        "--tools",
        default=None,
        metavar="FILE",
        help="a JSON file holding the request's tools array (with --system; part of the key)",
    )
    parser.add_argument("--cache-salt", default=None, help="the request's cache_salt (with --system)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def read_tools(path: str) -> list[Any]:
    """The tools array in the JSON file ``path``; ValueError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tools {path}: cannot read a JSON file: {exc}") from None
    if not isinstance(tools, list):
        raise ValueError(f"--tools {path}: expected a JSON array of tools, got {type(tools).__name__}")
    return tools


def run(args: argparse.Namespace) -> int:
    try:
        ring = HashRing(args.replica)
        unknown = [d for d in args.down if d not in ring]
        if unknown:
            raise ValueError(f"--down {unknown} not among the --replica names {list(ring.names)}")
        if args.key is not None:
            if args.cache_salt is not None or args.tools is not None:
                raise ValueError("--cache-salt and --tools apply to --system only: a --key is already computed")
            key = args.key
        else:
            body = {
                "messages": [{"role": "system", "content": args.system}],
                "cache_salt": args.cache_salt,
                "tools": read_tools(args.tools) if args.tools else None,
            }
            key = routing_key({k: v for k, v in body.items() if v is not None})
    except ValueError as e:
        print(f"prefixserve route: error: {e}", file=sys.stderr)
        return 2
    if key is None:
        if args.json:
            print(json.dumps({"key": None, "affinity": False}))
        else:
            print(
                "no routing key: the static prefix is empty, so the request has no affinity "
                "(the policy routes it by load)"
            )
        return 0

    down = set(args.down)
    usable = [n for n in ring.names if n not in down]
    result = {
        "key": key,
        "affinity": True,
        "crc32": key_hash(key),
        "owner": ring.owner(key),
        "replica": ring.lookup(key, usable),
        "nginx_replica": ring.nginx_pick(key, usable),
        "successors": ring.successors(key, usable),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{PREFIX_HASH_HEADER}: {key}")
    print(f"crc32:         {result['crc32']}")
    print(f"ring owner:    {result['owner']}")
    print(f"replica:       {result['replica'] or '(none usable)'}")
    if result["nginx_replica"] != result["replica"]:
        print("nginx:         round-robin (more than 20 unusable points in a row)")
    print(f"fallbacks:     {', '.join(result['successors'][1:]) or '(none)'}")
    return 0
