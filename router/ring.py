"""The consistent-hash ring (design Contract 3), point for point nginx's ``hash $key consistent``.

Job: place replicas on a ring exactly as nginx 1.22's ngx_http_upstream_hash_module
does, so that a key lands on the same replica through the Python router and
through nginx; and offer the bounded-load lookup of Mirrokni, Thorup and
Zadimoghaddam (2018) on the same ring.

nginx's construction (ngx_http_upstream_init_chash), reproduced here:

* A server's name is the string written in the ``server`` directive
  (``host:port``). It splits into host and port the nginx way: a name starting
  with ``unix:`` is all host; otherwise the port is the run of digits after the
  last ``:`` (when that run reaches the end of the name); a name without one is
  all host with an empty port. Ray Serve replicas are placed by a stable name
  the same way (``SERVE_REPLICA::app#Engine#ab12x`` is all host).
* ``base = crc32(host || 0x00 || port)``; each server gets ``160 * weight``
  points, point j = crc32 continued from ``base`` over ``le32(point j-1)``,
  point -1 = 0. Servers with weight 0 do not exist in nginx (weight >= 1).
  nginx sets no upper bound, but every unit of weight costs 160 points of
  memory and build time here and in nginx; weights stop at ``MAX_WEIGHT`` (a
  1% resolution of relative capacity).
* All points are sorted by hash (stably, in server order: the first server in
  the list keeps a hash two servers share) and equal hashes are dropped.
* A key hashes to ``crc32(key)`` (zlib's CRC-32 of its UTF-8 bytes); the lookup
  starts at the first point >= that hash, wrapping to point 0.
* A point whose server is unusable (``down``, failed, over capacity) is skipped:
  the walk moves to the next point. Unusable servers keep their points, so a
  server going down moves only its own keys, each to the next ring point.
* nginx gives up after 20 skipped points and picks round-robin instead. That
  choice depends on nginx's internal state, so it cannot be mirrored; the
  Python lookup keeps walking (deterministically) and ``nginx_pick`` reports
  None where nginx would round-robin. The two differ only when 21 consecutive
  points belong to unusable servers (probability about (down/R)**21).

A ring is immutable: build a new one per membership change (O(P log P) for P
points); lookups are a bisect plus a short walk.

Pure Python (zlib, bisect): must not import Ray, HTTP frameworks or torch.
"""

from __future__ import annotations

import bisect
import math
import struct
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

POINTS_PER_WEIGHT = 160
# 100 * 160 points per server builds in ~50 ms; 200000 took minutes.
MAX_WEIGHT = 100
NGINX_MAX_SKIPS = 20
DEFAULT_EPSILON = 0.25

Usable = Callable[[str], bool] | Collection[str] | None


@dataclass(frozen=True)
class RingServer:
    """One ring member: its name (``host:port`` or any stable name) and weight in 1..MAX_WEIGHT."""

    name: str
    weight: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a ring server needs a non-empty name")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int) or not 1 <= self.weight <= MAX_WEIGHT:
            raise ValueError(f"weight of {self.name!r} must be an integer from 1 to {MAX_WEIGHT}, got {self.weight!r}")

    @classmethod
    def parse(cls, spec: str) -> RingServer:
        """Parse ``HOST:PORT[=WEIGHT]`` (or ``NAME[=WEIGHT]``), as the CLIs take it."""
        name, sep, weight = spec.strip().rpartition("=")
        if not sep:
            return cls(spec.strip())
        try:
            w = int(weight)
        except ValueError:
            raise ValueError(f"bad replica {spec!r}: the weight after '=' must be an integer") from None
        return cls(name, w)


def split_server_name(name: str) -> tuple[bytes, bytes]:
    """Host and port bytes of a server name, split as nginx's chash init does."""
    raw = name.encode("utf-8")
    if raw.startswith(b"unix:"):
        return raw, b""
    j = 0
    while j < len(raw):
        c = raw[len(raw) - j - 1]
        if c == ord(":"):
            return raw[: len(raw) - j - 1], raw[len(raw) - j :]
        if not ord("0") <= c <= ord("9"):
            break
        j += 1
    return raw, b""


def server_points(name: str, weight: int = 1) -> list[int]:
    """The ``160 * weight`` ring points of one server, in generation order."""
    host, port = split_server_name(name)
    base = zlib.crc32(host + b"\x00" + port)
    points = []
    prev = 0
    for _ in range(POINTS_PER_WEIGHT * weight):
        prev = zlib.crc32(struct.pack("<I", prev), base)
        points.append(prev)
    return points


def key_hash(key: str | bytes) -> int:
    """crc32 of a routing key (its UTF-8 bytes), as nginx hashes ``$http_x_prefix_hash``."""
    return zlib.crc32(key.encode("utf-8") if isinstance(key, str) else key)


def bounded_capacity(total_in_flight: int, num_replicas: int, epsilon: float = DEFAULT_EPSILON) -> int:
    """``ceil((1 + epsilon) * (n + 1) / R)``: the most in-flight requests one replica may hold.

    Computed in exact rational arithmetic (epsilon taken as the decimal it
    prints as), so every router process gets the same integer.
    """
    if num_replicas < 1:
        raise ValueError("bounded capacity needs at least one replica")
    if total_in_flight < 0:
        raise ValueError(f"in-flight count must be >= 0, got {total_in_flight}")
    return math.ceil((1 + _exact(epsilon)) * (total_in_flight + 1) / num_replicas)


def _exact(epsilon: float) -> Fraction:
    if not epsilon >= 0 or math.isinf(epsilon):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    return Fraction(repr(float(epsilon)))


def _usable_fn(usable: Usable) -> Callable[[str], bool]:
    if usable is None:
        return lambda _name: True
    if callable(usable):
        return usable
    members = frozenset(usable)
    return members.__contains__


# The largest (points x servers) distance table a ring builds (32 MB of int32: 64 servers at
# 160 points per weight take 2.6 MB, 256 servers 42 MB and walk instead).
_MAX_DISTANCE_TABLE = 1 << 23


class HashRing:
    """nginx-compatible consistent-hash ring over named, weighted servers.

    ``servers`` are RingServer objects, names (weight 1) or ``(name, weight)``
    pairs; their order matters only for the (rare) shared point hash, as in
    nginx's config order.
    """

    def __init__(self, servers: Iterable[RingServer | str | tuple[str, int]]):
        members: list[RingServer] = []
        for s in servers:
            if isinstance(s, RingServer):
                members.append(s)
            elif isinstance(s, str):
                members.append(RingServer(s))
            else:
                name, weight = s
                members.append(RingServer(name, weight))
        names = [m.name for m in members]
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"ring server names must be unique; repeated: {dupes}")
        self._servers: tuple[RingServer, ...] = tuple(members)
        self._weights = {m.name: m.weight for m in members}

        tagged = [(h, i) for i, m in enumerate(members) for h in server_points(m.name, m.weight)]
        tagged.sort()  # by hash, then server order: the first server keeps a shared hash
        hashes: list[int] = []
        owners: list[int] = []
        for h, i in tagged:
            if hashes and hashes[-1] == h:
                continue
            hashes.append(h)
            owners.append(i)
        self._hashes = hashes
        self._owners = owners
        self._names = tuple(names)
        # Distinct servers in ring order from each point, filled on first use: the
        # ring is immutable, and routers ask for the same few thousand points again
        # and again (the simulator: 100k lookups over 64 replicas).
        self._order_from: dict[int, tuple[str, ...]] = {}
        self._distances: np.ndarray | None = None  # see _distance_table
        self._distances_too_big = False
        self._num_owning = 0  # servers that own at least one point

    # -- membership -----------------------------------------------------------------
    @property
    def servers(self) -> tuple[RingServer, ...]:
        return self._servers

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def weight(self, name: str) -> int:
        return self._weights[name]

    def __len__(self) -> int:
        return len(self._servers)

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    @property
    def num_points(self) -> int:
        return len(self._hashes)

    def with_server(self, server: RingServer | str) -> HashRing:
        """A new ring with one more server (appended, as a new last ``server`` line)."""
        return HashRing([*self._servers, server])

    def without_server(self, name: str) -> HashRing:
        """A new ring without ``name`` (a server removed from the config, not marked down)."""
        if name not in self._weights:
            raise ValueError(f"{name!r} is not on the ring; members: {list(self._names)}")
        return HashRing([s for s in self._servers if s.name != name])

    # -- lookup ---------------------------------------------------------------------
    def start_index(self, key: str | bytes) -> int:
        """Index of the first point >= crc32(key), wrapped to 0 past the last point."""
        if not self._hashes:
            raise ValueError("the ring is empty: add at least one server")
        i = bisect.bisect_left(self._hashes, key_hash(key))
        return 0 if i == len(self._hashes) else i

    def walk(self, key: str | bytes) -> Iterator[str]:
        """Server names of the points from the key's point on, once around the ring."""
        start = self.start_index(key)
        n = len(self._hashes)
        for step in range(n):
            yield self._names[self._owners[(start + step) % n]]

    def owner(self, key: str | bytes) -> str:
        """The server owning the key's point (all servers usable)."""
        return self._names[self._owners[self.start_index(key)]]

    def lookup(self, key: str | bytes, usable: Usable = None) -> str | None:
        """First usable server from the key's point on; None when none is usable.

        ``usable`` is a predicate on names or a collection of usable names
        (None: all). Unlike nginx this never falls back to round-robin.
        """
        ok = _usable_fn(usable)
        for name in self.walk(key):
            if ok(name):
                return name
        return None

    def nginx_pick(self, key: str | bytes, usable: Usable = None) -> str | None:
        """What nginx picks for ``key``, or None where nginx falls back to round-robin.

        nginx skips at most 20 points; with a single server it always uses
        round-robin (which then picks that server if usable).
        """
        ok = _usable_fn(usable)
        if len(self._servers) == 1:
            only = self._names[0]
            return only if ok(only) else None
        for skipped, name in enumerate(self.walk(key)):
            if skipped > NGINX_MAX_SKIPS:
                return None
            if ok(name):
                return name
        return None

    def _distinct_order(self, start: int) -> tuple[str, ...]:
        """Every server once, in ring order from point ``start``."""
        order = self._order_from.get(start)
        if order is None:
            distances = self._distance_table()
            if distances is not None:
                # A server's distance from ``start`` to its first point is unique (a point has one
                # owner), so sorting by it is the walk's order; servers left with no point sort last
                # (distance n) and are cut, as the walk never meets them.
                ranked = np.argsort(distances[start], kind="stable")[: self._num_owning].tolist()
                order = tuple(map(self._names.__getitem__, ranked))
            else:
                seen: dict[str, None] = {}
                n = len(self._hashes)
                for step in range(n):
                    seen.setdefault(self._names[self._owners[(start + step) % n]])
                    if len(seen) == len(self._names):
                        break
                order = tuple(seen)
            self._order_from[start] = order
        return order

    def _distance_table(self) -> np.ndarray | None:
        """Per point and server: points from it to the server's first point at or after it (cyclic).

        Built on first use, in a few milliseconds for 64 servers: the order from a
        point never walked before is then one argsort of a row instead of a walk
        of about ``R ln R`` points (a router's decision on a new key). None for a
        ring over ``_MAX_DISTANCE_TABLE`` entries, which walks.
        """
        if self._distances is None and not self._distances_too_big:
            n, r = len(self._hashes), len(self._names)
            if n * r > _MAX_DISTANCE_TABLE:
                self._distances_too_big = True
                return None
            owners = np.asarray(self._owners, dtype=np.int64)
            starts = np.arange(n)
            table = np.full((n, r), n, dtype=np.int32)
            owning = 0
            for j in range(r):
                points = np.flatnonzero(owners == j)
                if not len(points):
                    continue
                owning += 1
                nxt = np.searchsorted(points, starts)
                wrapped = nxt == len(points)
                table[:, j] = points[np.where(wrapped, 0, nxt)] + np.where(wrapped, n, 0) - starts
            self._distances = table
            self._num_owning = owning
        return self._distances

    def order(self, key: str | bytes) -> tuple[str, ...]:
        """Every server once, in ring order from the key's point (``successors`` with all usable).

        Memoized per ring point: the tuple is shared by every key on that point.
        """
        return self._distinct_order(self.start_index(key))

    def successors(self, key: str | bytes, usable: Usable = None, limit: int | None = None) -> list[str]:
        """Distinct usable servers in ring order from the key's point: the owner first,
        then where the key goes if the owner fails, and so on."""
        if usable is None:
            return list(self.order(key)[:limit])
        ok = _usable_fn(usable)
        want = len(self._servers) if limit is None else min(limit, len(self._servers))
        seen: list[str] = []
        for name in self._distinct_order(self.start_index(key)):
            if len(seen) >= want:
                break
            if ok(name):
                seen.append(name)
        return seen

    def bounded_lookup(
        self,
        key: str | bytes,
        in_flight: Mapping[str, int],
        epsilon: float = DEFAULT_EPSILON,
        usable: Usable = None,
    ) -> str | None:
        """Consistent hashing with bounded loads.

        Among the usable servers (R of them, holding n in-flight requests in
        total per ``in_flight``; missing names count 0) the capacity is
        ``ceil((1 + epsilon) * (n + 1) / R)``; the lookup walks from the key's
        point to the first usable server holding fewer than that. Since
        R * capacity > n, such a server always exists. None when no server is usable.
        """
        ok = _usable_fn(usable)
        live = [name for name in self._names if ok(name)]
        if not live:
            return None
        loads = {name: in_flight.get(name, 0) for name in live}
        cap = bounded_capacity(sum(loads.values()), len(live), epsilon)
        for name in self._distinct_order(self.start_index(key)):
            load = loads.get(name)
            if load is not None and load < cap:
                return name
        raise AssertionError("unreachable: R * capacity > n guarantees a server under capacity")

    # -- checks ---------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the ring's structure is inconsistent."""
        assert len(self._hashes) == len(self._owners)
        assert all(a < b for a, b in zip(self._hashes, self._hashes[1:])), "points not strictly sorted"
        assert all(0 <= h <= 0xFFFFFFFF for h in self._hashes), "point outside 32 bits"
        assert len(set(self._names)) == len(self._names), "duplicate server names"
        first_owner: dict[int, int] = {}
        for i, s in enumerate(self._servers):
            for h in server_points(s.name, s.weight):
                first_owner.setdefault(h, i)
        assert sorted(first_owner) == self._hashes, "points differ from the servers' generated points"
        assert all(first_owner[h] == i for h, i in zip(self._hashes, self._owners)), (
            "a shared point hash is not owned by the first server listed"
        )
