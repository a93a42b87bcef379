"""``prefixserve nginx-config``: render an nginx.conf whose upstream places keys as router/ring.py does.

Job: for a list of standalone replicas (``prefixserve replica`` servers), write
a complete nginx configuration: a ``hash $http_x_prefix_hash consistent``
upstream (the same ring as router/ring.py, server lines in the order given),
a round-robin upstream for requests without the header, retries on failed or
overloaded replicas, and proxy settings that let SSE streams through unbuffered.

With ``--placement FILE|URL`` (a ``placed`` policy's ``placement_snapshot``
JSON, e.g. an ingress's ``GET /placement``), the upstream hashes
``$prefixserve_ring_key`` instead of the header: a ``map`` turns each key the
placement moved off its ring owner into a salted key (``KEY~i``, the smallest
``i`` whose ring owner is the placed replica; found with router/ring.py, which
is nginx's ring), and a key placed on several replicas (a replicated hot key)
into a ``split_clients`` variable spreading its requests evenly over one
salted key per replica. Keys the ring already places where the snapshot does
are left out of the map. The snapshot's members must be the configured
servers (``host:port``).

With ``--key-log PATH`` the front server also logs each request's time, its
original ``X-Prefix-Hash`` (never the salted ring key), status and upstream as
one JSON object per line (``log_format prefixserve_keys``): the input of
``prefixserve placement`` (router/nginx/placement.py), which replays it through
the ``placed`` policy and writes the snapshot ``--placement`` renders.

Invariants: the ``server`` names are written exactly as given (the ring hashes
those strings); the output is accepted by ``nginx -t`` (tested with a real
nginx). The sample nginx/nginx.conf is this module's output for the replicas
named in its header.

Pure Python: must not import Ray, HTTP frameworks or torch.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import sys
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixserve.router.cli.common import arg_type, write_output
from prefixserve.router.policies.placement import SNAPSHOT_FORMAT
from prefixserve.router.ring import HashRing, RingServer
from prefixserve.router.routing_key import PREFIX_HASH_HEADER

# Characters nginx would read as syntax in a bare config token (and any control character).
_UNSAFE = re.compile(r"[\s;{}#\"'$\\\x00-\x1f\x7f]")
_HEADER_VAR = "$http_" + PREFIX_HASH_HEADER.lower().replace("-", "_")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_SIZE = re.compile(r"[0-9]{1,9}[kKmMgG]?")
# nginx's NGX_MAX_PROCESSES.
MAX_WORKER_PROCESSES = 1024
# Longest duration or count written into the config: nginx refuses larger time values.
MAX_SECONDS = 10 * 365 * 24 * 3600


# Keys the placement map may name: Contract 1 keys are 16 hex digits; others must be plain tokens.
_MAP_KEY = re.compile(r"[a-z0-9._:~+/=@-]{1,128}")
# A salt search gives up after this many candidates (a replica owns >= 1/R of the ring: R tries on average).
MAX_SALT_TRIES = 100_000
RING_KEY_VAR = "$prefixserve_ring_key"
# The routing-key log (--key-log): one JSON object per request, fields -> nginx variables.
# escape=json writes a missing header as "" and escapes quotes and controls, so every line is JSON.
KEY_LOG_FORMAT = "prefixserve_keys"
KEY_LOG_FIELDS: tuple[tuple[str, str], ...] = (
    ("msec", "$msec"),  # seconds.milliseconds when the line is written (the request's end)
    ("key", _HEADER_VAR),  # the client's header: what the placement map is keyed by
    ("status", "$status"),
    ("upstream", "$upstream_addr"),  # "a, b" when nginx retried on the next ring replica
)


# -- validation: each returns the value as written into the config, or raises ValueError ----------


def check_token(value: str, what: str) -> str:
    """``value`` if nginx reads it as one bare token, else ValueError (the renderer's last guard)."""
    if not isinstance(value, str) or not value or _UNSAFE.search(value):
        raise ValueError(f"{what} {value!r} is not a single nginx token (no spaces, quotes, ;{{}}#$\\ or controls)")
    return value


def check_host(host: str, *, wildcard: bool = False) -> str:
    """A hostname, an IPv4 address or a bracketed IPv6 address (``*`` too when ``wildcard``)."""
    if wildcard and host == "*":
        return host
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"{host!r} is not a valid [IPv6] address") from None
        return host
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not a valid IPv4 address") from None
        return host
    if len(host) > 253 or not _HOSTNAME.fullmatch(host):
        raise ValueError(f"{host!r} is not a valid host name, IPv4 address or [IPv6] address")
    return host


def check_port(port: str) -> str:
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port!r} must be a number from 1 to 65535")
    return port


def _split_host_port(value: str) -> tuple[str, str | None]:
    if value.startswith("["):  # [v6] or [v6]:port
        end = value.find("]")
        if end < 0:
            raise ValueError(f"{value!r}: unclosed '[' of an IPv6 address")
        rest = value[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{value!r}: expected ':PORT' after the IPv6 address")
        return value[: end + 1], rest[1:] if rest else None
    host, sep, port = value.rpartition(":")
    return (host, port) if sep else (value, None)


def check_listen(value: str) -> str:
    """``PORT`` or ``HOST:PORT`` (HOST: a name, IPv4, [IPv6] or ``*``)."""
    if re.fullmatch(r"[0-9]+", value):
        return check_port(value)
    host, port = _split_host_port(value)
    if port is None:
        raise ValueError(f"listen {value!r} must be PORT or HOST:PORT")
    check_host(host, wildcard=True)
    check_port(port)
    return value


def check_server_address(value: str) -> str:
    """An upstream ``server`` address: ``HOST[:PORT]`` or ``unix:/absolute/path``."""
    if value.startswith("unix:"):
        path = value[len("unix:") :]
        if not path.startswith("/"):
            raise ValueError(f"replica {value!r}: a unix socket needs an absolute path (unix:/run/x.sock)")
        return check_token(value, "replica")
    host, port = _split_host_port(value)
    try:
        check_host(host)
        if port is not None:
            check_port(port)
    except ValueError as exc:
        raise ValueError(f"replica {value!r}: {exc}") from None
    return value


def check_worker_processes(value: str) -> str:
    if value == "auto" or (re.fullmatch(r"[0-9]{1,4}", value) and 1 <= int(value) <= MAX_WORKER_PROCESSES):
        return value
    raise ValueError(f"worker processes must be 'auto' or a number from 1 to {MAX_WORKER_PROCESSES}, got {value!r}")


def check_path(value: str) -> str:
    return check_token(value, "path")


def check_key_log(value: str) -> str:
    """A key log path: one bare token, not ``off`` (that would turn every access log off)."""
    check_path(value)
    if value == "off":
        raise ValueError("the key log needs a file path ('off' would turn off every access log of the server)")
    return value


def check_output(value: str) -> str:
    """An output file whose directory exists (a typo in it should not create a tree)."""
    parent = Path(value).parent
    if not parent.is_dir():
        raise ValueError(f"the directory of {value!r} does not exist; create it first")
    if Path(value).is_dir():
        raise ValueError(f"{value!r} is a directory; give a file name")
    return value


def check_replica(spec: str) -> RingServer:
    """``HOST:PORT[=WEIGHT]`` as an upstream server of the ring."""
    server = RingServer.parse(spec)
    check_server_address(server.name)
    return server


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not re.fullmatch(r"[0-9]{1,12}", value.strip()) or not lo <= int(value) <= hi:
            raise ValueError(f"expected a whole number from {lo} to {hi}, got {value!r}")
        return int(value)

    return parse


def salted_key(key: str, replica: str, ring: HashRing) -> str:
    """``key`` itself when ``replica`` owns it on ``ring``, else ``key~i`` for the smallest i that it owns."""
    for i in range(MAX_SALT_TRIES):
        candidate = key if i == 0 else f"{key}~{i}"
        if ring.owner(candidate) == replica:
            return candidate
    raise ValueError(f"no salted key of {key!r} lands on {replica!r} within {MAX_SALT_TRIES} tries")


@dataclass(frozen=True)
class PlacementMap:
    """Keys whose placement differs from the ring: key -> one salted key per placed replica (primary first).

    version: the snapshot's version (written in a comment); skipped: keys that
    are not safe map tokens (left to the ring).
    """

    entries: tuple[tuple[str, tuple[str, ...]], ...]
    version: int = 0
    skipped: int = 0

    @classmethod
    def from_snapshot(cls, snapshot: Mapping[str, Any], servers: Sequence[RingServer]) -> PlacementMap:
        """The map for a ``placement_snapshot`` over these nginx ``servers`` (their ring, weights included).

        ValueError, naming what is wrong, for a snapshot of another format, a
        malformed ``members``, ``version`` or per-key ``replicas`` field, or
        replicas that are not among ``servers``.
        """
        if not isinstance(snapshot, Mapping) or not isinstance(snapshot.get("keys"), Mapping):
            raise ValueError("the placement is not a placement snapshot (it needs 'members' and 'keys')")
        if snapshot.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(
                f"the placement's format {snapshot.get('format')!r} is not one this version reads "
                f"(expected {SNAPSHOT_FORMAT})"
            )
        version = snapshot.get("version", 0)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"the placement's version must be a whole number >= 0, got {version!r}")
        names = [s.name for s in servers]
        members = snapshot.get("members") or []
        if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
            raise ValueError("the placement's members must be a list of replica names")
        unknown = sorted(set(members) - set(names))
        if unknown:
            raise ValueError(
                f"the placement's members {unknown} are not among the replicas {names}: render it "
                "from a placement over the nginx servers (host:port)"
            )
        ring = HashRing(servers)
        entries = []
        skipped = 0
        for key, entry in sorted(snapshot["keys"].items()):
            replicas = _entry_replicas(key, entry, names)
            if not replicas:
                continue
            if not _MAP_KEY.fullmatch(str(key)):
                skipped += 1
                continue
            if len(replicas) == 1 and ring.owner(key) == replicas[0]:
                continue  # the ring already sends it there
            entries.append((str(key), tuple(salted_key(str(key), r, ring) for r in replicas)))
        return cls(tuple(entries), version, skipped)


def _entry_replicas(key: str, entry: Any, names: Sequence[str]) -> list[str]:
    """The replicas one snapshot key is placed on (primary first); ValueError if the entry is malformed."""
    replicas = entry.get("replicas") if isinstance(entry, Mapping) else None
    where = f"the placement's key {key[:40]!r}"
    if not isinstance(replicas, list) or not all(isinstance(r, str) for r in replicas):
        got = type(entry).__name__ if not isinstance(entry, Mapping) else type(replicas).__name__
        raise ValueError(f"{where}: 'replicas' must be a list of replica names, got {got}")
    if len(set(replicas)) != len(replicas):
        raise ValueError(f"{where}: 'replicas' names a replica twice: {replicas}")
    unknown = sorted(set(replicas) - set(names))
    if unknown:
        raise ValueError(f"{where}: replicas {unknown} are not among the replicas {list(names)}")
    return replicas


def load_placement(source: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """A placement snapshot from a file or an ``http(s)://`` URL (an ingress's ``/placement``)."""
    try:
        if source.startswith(("http://", "https://")):
            with urllib.request.urlopen(source, timeout=timeout_s) as response:  # noqa: S310 (http(s) only)
                data = json.loads(response.read().decode("utf-8"))
        else:
            data = json.loads(Path(source).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the placement from {source}: {exc}") from None
    except RecursionError:  # the JSON decoder recurses per nesting level
        raise ValueError(f"cannot read the placement from {source}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"the placement in {source} is not a JSON object")
    return data


def _split_shares(n: int) -> list[str]:
    """``n`` equal split_clients shares (the last one is ``*``), two decimals as nginx takes them."""
    share = f"{int(10000 / n) / 100:.2f}%"
    return [share] * (n - 1) + ["*"]


@dataclass(frozen=True)
class NginxConfig:
    """Everything the rendered nginx.conf depends on.

    replicas: the upstream servers, in order (order matters to nginx only for
        the rare shared ring point; keep it stable).
    down: names among ``replicas`` marked ``down`` (they keep their ring points).
    listen: ``PORT`` or ``ADDR:PORT`` of the front server.
    max_fails / fail_timeout_s: passive health check per replica.
    read_timeout_s: longest silence while a replica generates (non-streamed
        responses are silent until the end).
    next_upstream_tries: replicas one request may try (1 disables retries).
    retry_non_idempotent: also retry POSTs already sent to a replica (see the
        comment in the output).
    keepalive: idle upstream connections kept per worker.
    temp_dir / pid_file / error_log / access_log: file locations (None keeps
        nginx's compiled-in defaults; "off" is accepted for access_log).
    key_log: the routing-key log of the front server (``prefixserve placement``'s
        input), or None. Like any access_log it replaces nginx's compiled-in
        default access log there; give access_log too to keep one.
    includes: extra files included in the ``http`` block (e.g. more servers).
    placement: keys placed off their ring owner (``--placement``), or None.
    """

    replicas: tuple[RingServer, ...]
    down: frozenset[str] = frozenset()
    listen: str = "8080"
    max_fails: int = 3
    fail_timeout_s: int = 10
    read_timeout_s: int = 600
    connect_timeout_s: int = 5
    next_upstream_tries: int = 2
    retry_non_idempotent: bool = True
    keepalive: int = 32
    client_max_body_size: str = "16m"
    worker_processes: str = "auto"
    temp_dir: str | None = None
    pid_file: str | None = None
    error_log: str | None = None
    access_log: str | None = None
    key_log: str | None = None
    includes: tuple[str, ...] = field(default_factory=tuple)
    command: str | None = None
    placement: PlacementMap | None = None

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("give at least one --replica HOST:PORT")
        names = [r.name for r in self.replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {names}")
        for name in names:
            if _UNSAFE.search(name):
                raise ValueError(f"replica {name!r} contains characters nginx would misread")
            check_server_address(name)
        unknown = sorted(set(self.down) - set(names))
        if unknown:
            raise ValueError(f"down replicas {unknown} are not among the replicas {names}")
        if len(set(self.down)) == len(names):
            raise ValueError("every replica is marked down; leave at least one usable")
        check_listen(self.listen)
        check_worker_processes(self.worker_processes)
        if not _SIZE.fullmatch(self.client_max_body_size):
            raise ValueError(f"client_max_body_size must be a size like 16m, got {self.client_max_body_size!r}")
        for attr in ("max_fails", "fail_timeout_s", "read_timeout_s", "connect_timeout_s"):
            _int_in(0, MAX_SECONDS)(str(getattr(self, attr)))
        if not isinstance(self.keepalive, int) or not 1 <= self.keepalive <= 100_000:
            raise ValueError(f"keepalive must be from 1 to 100000 (nginx refuses 0), got {self.keepalive!r}")
        if not isinstance(self.next_upstream_tries, int) or not 1 <= self.next_upstream_tries <= 100:
            raise ValueError(f"next_upstream_tries must be from 1 to 100, got {self.next_upstream_tries!r}")
        for path in (self.temp_dir, self.pid_file, self.error_log, self.access_log, self.key_log, *self.includes):
            if path is not None and _UNSAFE.search(path):
                raise ValueError(f"path {path!r} contains characters nginx would misread")
        if self.key_log is not None:
            check_key_log(self.key_log)
        if self.command is not None and re.search(r"[\x00-\x1f\x7f]", self.command):
            raise ValueError("the command echoed in the header comment must be one line")


def _server_line(cfg: NginxConfig, r: RingServer) -> str:
    parts = [f"server {check_token(r.name, 'replica')}"]
    if r.weight != 1:
        parts.append(f"weight={r.weight}")
    parts.append(f"max_fails={cfg.max_fails} fail_timeout={cfg.fail_timeout_s}s")
    if r.name in cfg.down:
        parts.append("down")
    return "        " + " ".join(parts) + ";"


def write_prefix_config(root: Path, listen: str, **fields: Any) -> Path:
    """Render ``root/nginx.conf`` for an nginx run as ``nginx -p root -c root/nginx.conf``: one worker,
    its pid file, error log and temp files under ``root`` (``logs/`` and ``tmp/`` made here), no access log;
    ``fields`` are the rest of the NginxConfig (the replicas, includes, ...)."""
    for sub in ("logs", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = {
        "worker_processes": "1",
        "temp_dir": str(root / "tmp"),
        "pid_file": str(root / "nginx.pid"),
        "error_log": str(root / "logs" / "error.log"),
        "access_log": "off",
        **fields,
    }
    conf = root / "nginx.conf"
    conf.write_text(render_config(NginxConfig(listen=listen, **settings)))
    return conf


def render_config(cfg: NginxConfig) -> str:
    """The complete nginx.conf text for ``cfg``.

    Every value written as a directive argument is checked to be one bare
    token here too, so a config built around ``NginxConfig``'s checks still
    cannot add directives.
    """
    for what, value in (
        ("listen", cfg.listen),
        ("worker_processes", cfg.worker_processes),
        ("client_max_body_size", cfg.client_max_body_size),
    ):
        check_token(value, what)
    for path in (cfg.temp_dir, cfg.pid_file, cfg.error_log, cfg.access_log, *cfg.includes):
        if path is not None:
            check_path(path)
    if cfg.key_log is not None:
        check_key_log(cfg.key_log)
    numbers = (
        cfg.max_fails,
        cfg.fail_timeout_s,
        cfg.read_timeout_s,
        cfg.connect_timeout_s,
        cfg.next_upstream_tries,
        cfg.keepalive,
    )
    if not all(type(n) is int for n in numbers):
        raise ValueError(f"numeric settings must be integers, got {numbers}")
    if cfg.command is not None and "\n" in cfg.command:
        raise ValueError("the command echoed in the header comment must be one line")
    servers = "\n".join(_server_line(cfg, r) for r in cfg.replicas)
    hash_var = _HEADER_VAR if cfg.placement is None else RING_KEY_VAR
    retry_post = " non_idempotent" if cfg.retry_non_idempotent else ""
    out: list[str] = []
    w = out.append
    w("# nginx front for prefixserve replicas: requests with the same X-Prefix-Hash")
    w("# reach the same replica, placed exactly as prefixserve's router ring places them.")
    if cfg.command:
        w(f"# Generated by: {cfg.command}")
    w("# Check with `nginx -t -c <this file>`; see nginx/README.md.")
    w("")
    w(f"worker_processes {cfg.worker_processes};")
    if cfg.pid_file:
        w(f"pid {cfg.pid_file};")
    if cfg.error_log:
        w(f"error_log {cfg.error_log};")
    w("")
    w("events {")
    w("    worker_connections 4096;")
    w("}")
    w("")
    w("http {")
    if cfg.access_log:
        w(f"    access_log {cfg.access_log};")
    if cfg.temp_dir:
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            w(f"    {kind}_temp_path {cfg.temp_dir}/{kind};")
    if cfg.key_log is not None:
        w(_key_log_format())
    w(f"""
    # Clients send {PREFIX_HASH_HEADER}: the first 16 hex digits of SHA-256 over the
    # request's static prefix (its leading system/developer messages joined by "\\n";
    # with a cache_salt, the salt and a 0x00 byte first). Requests without it have no
    # prefix affinity and are balanced round-robin by the second upstream.
    map {_HEADER_VAR} $prefixserve_upstream {{
        ""      prefixserve_rr;
        default prefixserve_hash;
    }}

    # The ring: 160 points per unit of weight for each "host:port" as written here,
    # crc32 chained; a key goes to the first point >= crc32(key). A replica that is
    # down (or failed max_fails times within fail_timeout) keeps its points and is
    # skipped: only its keys move, each to the next replica on the ring. Keep the
    # server names identical to those given to `prefixserve route`/the router.
{_placement_block(cfg.placement)}    upstream prefixserve_hash {{
        hash {hash_var} consistent;
{servers}
        # After the balancing method (nginx requires this order): idle connections
        # to replicas are reused instead of opening one per request.
        keepalive {cfg.keepalive};
    }}

    upstream prefixserve_rr {{
{servers}
        keepalive {cfg.keepalive};
    }}

    server {{
        listen {cfg.listen};

        # Prompts with long system messages are large; the replica enforces its own limit.
        client_max_body_size {cfg.client_max_body_size};
{_key_log_lines(cfg)}
        location / {{
            proxy_pass http://$prefixserve_upstream;

            # Server-sent events: HTTP/1.1 keep-alive to the replica, no buffering, so
            # each token reaches the client when the replica writes it.
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffering off;
            gzip off;

            # Generation can be silent for minutes (a non-streamed long answer).
            proxy_connect_timeout {cfg.connect_timeout_s}s;
            proxy_send_timeout {cfg.read_timeout_s}s;
            proxy_read_timeout {cfg.read_timeout_s}s;

            # A replica that refuses (502/503, or 429 when overloaded) or cannot be
            # reached: try the next replica on the ring, which is where the key would
            # move anyway. 429 and 503 also count toward max_fails, so an overloaded
            # replica is taken out for fail_timeout and its keys move meanwhile.
            # POST is not idempotent, so nginx does not retry a request it already sent
            # unless told to: "non_idempotent" allows it. A completion has no side effect
            # besides the compute it costs, and a replica that answered 429/503 did not
            # start it; once a response has begun streaming to the client nginx never
            # retries. Drop "non_idempotent" to never send a POST twice.
            proxy_next_upstream error timeout http_502 http_503 http_429{retry_post};
            proxy_next_upstream_tries {cfg.next_upstream_tries};

            # Which replica answered (handy with `prefixserve route`).
            add_header X-Prefixserve-Upstream $upstream_addr always;
        }}
    }}""")
    for path in cfg.includes:
        w(f"\n    include {path};")
    w("}")
    return "\n".join(out) + "\n"


def _key_log_format() -> str:
    """The ``log_format`` of the routing-key log (http block lines, after a blank line)."""
    fields = ",".join(f'"{name}":"{var}"' for name, var in KEY_LOG_FIELDS)
    return (
        "\n    # The routing-key log (--key-log): one JSON object per request with the client's\n"
        f"    # {PREFIX_HASH_HEADER} as sent (not the salted ring key), for `prefixserve placement`.\n"
        f"    log_format {KEY_LOG_FORMAT} escape=json '{{{fields}}}';"
    )


def _key_log_lines(cfg: NginxConfig) -> str:
    """The front server's ``access_log`` lines when it writes the key log ('' without ``key_log``).

    In the server block, so that servers added with ``include`` do not write the
    key log. An access_log there replaces those inherited from the http block, so
    the general access log (when one is given and not "off") is repeated.
    """
    if cfg.key_log is None:
        return ""
    lines = ["", "        # Each request's routing key: `prefixserve placement <this log> --replica ...` replays it."]
    general = cfg.access_log is not None and cfg.access_log != "off"
    if general:
        lines.append("        # An access_log here replaces the http block's: the general one is named again.")
    elif cfg.access_log is None:
        lines.append("        # It replaces nginx's default access log here (render with --access-log to keep one).")
    lines.append(f"        access_log {cfg.key_log} {KEY_LOG_FORMAT};")
    if general:
        lines.append(f"        access_log {cfg.access_log};")
    return "\n".join(lines) + "\n"


def _placement_block(placement: PlacementMap | None) -> str:
    """The ``split_clients`` and ``map`` blocks of a placement ('' without one)."""
    if placement is None:
        return ""
    for key, salted in placement.entries:
        for token in (key, *salted):
            if not _MAP_KEY.fullmatch(token.split("~", 1)[0]) or _UNSAFE.search(token):
                raise ValueError(f"placement key {token!r} is not one safe token")
    lines = [
        f"    # Placement (prefixserve's placed policy, snapshot version {placement.version}): keys the",
        "    # placement moved off their ring owner hash as a salted key that the placed replica owns;",
        "    # a key placed on several replicas is split evenly over one salted key per replica.",
        f"    # {len(placement.entries)} keys mapped; other keys hash as themselves.",
    ]
    if placement.skipped:
        lines.append(f"    # {placement.skipped} keys that are not plain tokens are left to the ring.")
    values: list[tuple[str, str]] = []
    for i, (key, salted) in enumerate(placement.entries):
        if len(salted) == 1:
            values.append((key, salted[0]))
            continue
        var = f"$prefixserve_split_{i}"
        lines.append(f'    split_clients "${{request_id}}" {var} {{')
        lines.extend(f"        {share} {s};" for share, s in zip(_split_shares(len(salted)), salted, strict=True))
        lines.append("    }")
        values.append((key, var))
    lines.append(f"    map {_HEADER_VAR} {RING_KEY_VAR} {{")
    lines.append(f"        default {_HEADER_VAR};")
    lines.extend(f"        {key} {value};" for key, value in values)
    lines.append("    }")
    return "\n".join(lines) + "\n\n"


def add_replica_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """``--replica HOST:PORT[=WEIGHT]``, repeated: the upstream servers (nginx-config, placement)."""
    parser.add_argument(
        "--replica",
        action="append",
        required=True,
        type=arg_type(check_replica),
        metavar="HOST:PORT[=WEIGHT]",
        help=help,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    seconds = arg_type(_int_in(0, MAX_SECONDS))
    add_replica_argument(parser, "an upstream replica; repeat in a stable order")
    parser.add_argument(
        "--down",
        action="append",
        default=[],
        type=arg_type(check_server_address),
        metavar="HOST:PORT",
        help="mark a listed replica down",
    )
    parser.add_argument(
        "--listen",
        default="8080",
        type=arg_type(check_listen),
        help="PORT or HOST:PORT nginx listens on (default 8080)",
    )
    parser.add_argument(
        "--max-fails",
        type=arg_type(_int_in(0, 1000)),
        default=3,
        help="failures that take a replica out (default 3; 0 never)",
    )
    parser.add_argument(
        "--fail-timeout", type=seconds, default=10, help="seconds a failed replica stays out (default 10)"
    )
    parser.add_argument(
        "--read-timeout", type=seconds, default=600, help="seconds of replica silence allowed (default 600)"
    )
    parser.add_argument(
        "--tries", type=arg_type(_int_in(1, 100)), default=2, help="replicas one request may try (default 2)"
    )
    parser.add_argument(
        "--no-retry-post", action="store_true", help="never resend a POST that reached a replica (drops non_idempotent)"
    )
    parser.add_argument(
        "--worker-processes",
        default="auto",
        type=arg_type(check_worker_processes),
        help=f"nginx worker_processes: auto or 1..{MAX_WORKER_PROCESSES} (default auto)",
    )
    parser.add_argument(
        "--temp-dir",
        default=None,
        type=arg_type(check_path),
        help="an existing directory for nginx's temp paths (default: nginx's own)",
    )
    parser.add_argument("--pid-file", default=None, type=arg_type(check_path), help="pid file (default: nginx's own)")
    parser.add_argument("--error-log", default=None, type=arg_type(check_path), help="error log (default: nginx's own)")
    parser.add_argument(
        "--access-log", default=None, type=arg_type(check_path), help="access log path or 'off' (default: nginx's own)"
    )
    parser.add_argument(
        "--key-log",
        default=None,
        type=arg_type(check_key_log),
        metavar="PATH",
        help="also log each request's time and X-Prefix-Hash here as JSON lines, the input of "
        "`prefixserve placement` (replaces nginx's default access log: add --access-log "
        "to keep one)",
    )
    parser.add_argument(
        "--include",
        action="append",
        default=[],
        type=arg_type(check_path),
        help="extra file to include in the http block",
    )
    parser.add_argument(
        "--placement",
        default=None,
        metavar="FILE|URL",
        help="render a placed policy's placement (a placement_snapshot JSON file, or a URL serving "
        "one such as an ingress's /placement) as a map of salted keys",
    )
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        type=arg_type(check_output),
        help="write here (its directory must exist) instead of stdout",
    )


def config_from_args(args: argparse.Namespace, command: str | None = None) -> NginxConfig:
    replicas = tuple(args.replica)
    source = getattr(args, "placement", None)
    placement = None if source is None else PlacementMap.from_snapshot(load_placement(source), replicas)
    return NginxConfig(
        replicas=replicas,
        down=frozenset(args.down),
        listen=str(args.listen),
        max_fails=args.max_fails,
        fail_timeout_s=args.fail_timeout,
        read_timeout_s=args.read_timeout,
        next_upstream_tries=args.tries,
        retry_non_idempotent=not args.no_retry_post,
        worker_processes=args.worker_processes,
        temp_dir=args.temp_dir,
        pid_file=args.pid_file,
        error_log=args.error_log,
        access_log=args.access_log,
        key_log=getattr(args, "key_log", None),
        includes=tuple(args.include),
        command=command,
        placement=placement,
    )


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        text = render_config(cfg)
    except ValueError as e:
        print(f"prefixserve nginx-config: error: {e}", file=sys.stderr)
        return 2
    return write_output("prefixserve nginx-config", text, args.output)
