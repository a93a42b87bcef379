"""Contract 3: the nginx-compatible ring and the bounded-load lookup (router/ring.py)."""

from __future__ import annotations

import math
import random
import struct
import zlib
from collections import Counter

import pytest

from prefixserve.router.ring import (
    POINTS_PER_WEIGHT,
    HashRing,
    RingServer,
    bounded_capacity,
    key_hash,
    server_points,
    split_server_name,
)


def _keys(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(64):016x}" for _ in range(n)]


def _servers(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < n:
        names.add(f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}:{rng.randrange(1024, 65536)}")
    return sorted(names)


# -- nginx's construction --------------------------------------------------------------


@pytest.mark.parametrize(
    "name, host, port",
    [
        ("127.0.0.1:8001", b"127.0.0.1", b"8001"),
        ("[::1]:8080", b"[::1]", b"8080"),
        ("replica-3.svc:80", b"replica-3.svc", b"80"),
        ("host:", b"host", b""),
        ("host", b"host", b""),
        ("name123", b"name123", b""),
        ("host:80a", b"host:80a", b""),
        ("unix:/run/replica.sock", b"unix:/run/replica.sock", b""),
        ("SERVE_REPLICA::app#Engine#ab12", b"SERVE_REPLICA::app#Engine#ab12", b""),
    ],
)
def test_server_name_split_like_nginx(name, host, port):
    assert split_server_name(name) == (host, port)


def test_points_are_the_crc32_chain_over_host_nul_port_prev():
    # Computed from whole byte strings, independently of the incremental crc32 in ring.py.
    pts = server_points("127.0.0.1:8001", weight=2)
    assert len(pts) == 2 * POINTS_PER_WEIGHT
    prev = 0
    for p in pts:
        expected = zlib.crc32(b"127.0.0.1" + b"\x00" + b"8001" + struct.pack("<I", prev))
        assert p == expected
        prev = p


def test_key_hash_is_zlib_crc32_of_utf8():
    assert key_hash("abc") == zlib.crc32(b"abc") == 0x352441C2
    assert key_hash(b"abc") == key_hash("abc")


# Observed from a real nginx 1.22.1 (Debian nginx-light), upstream:
#   hash $http_x_prefix_hash consistent;
#   server 127.0.0.1:18001; server 127.0.0.1:18002 weight=2; server 127.0.0.1:18003;
NGINX_VECTORS = {
    "tenant-0": "127.0.0.1:18001",
    "tenant-1": "127.0.0.1:18003",
    "tenant-2": "127.0.0.1:18001",
    "tenant-3": "127.0.0.1:18002",
    "tenant-4": "127.0.0.1:18002",
    "75357d685f238b6a": "127.0.0.1:18002",
    "400458a606a027e0": "127.0.0.1:18002",
    "a": "127.0.0.1:18002",
    "~": "127.0.0.1:18002",
    "0": "127.0.0.1:18001",
}


def test_fixed_vectors_from_real_nginx():
    ring = HashRing([RingServer("127.0.0.1:18001"), RingServer("127.0.0.1:18002", 2), RingServer("127.0.0.1:18003")])
    ring.check_invariants()
    assert {k: ring.owner(k) for k in NGINX_VECTORS} == NGINX_VECTORS
    assert {k: ring.nginx_pick(k) for k in NGINX_VECTORS} == NGINX_VECTORS


def test_lookup_is_first_point_at_or_after_key_hash_wrapping():
    ring = HashRing(_servers(1, 3))
    pts = sorted((p, s) for s in ring.names for p in server_points(s))
    for key in _keys(2, 500):
        h = key_hash(key)
        after = [s for p, s in pts if p >= h]
        assert ring.owner(key) == (after[0] if after else pts[0][1])


def test_check_invariants_and_point_count():
    names = _servers(3, 5)
    ring = HashRing([RingServer(n, w) for n, w in zip(names, [1, 2, 3, 1, 1])])
    ring.check_invariants()
    # Collisions are rare: 8 * 160 points, all kept.
    assert ring.num_points == 8 * POINTS_PER_WEIGHT
    assert len(ring) == 5 and names[0] in ring and "nope:1" not in ring


def test_bad_membership_rejected():
    with pytest.raises(ValueError, match="unique"):
        HashRing(["a:1", "a:1"])
    with pytest.raises(ValueError, match="weight"):
        RingServer("a:1", 0)
    with pytest.raises(ValueError, match="empty"):
        HashRing([]).owner("k")
    with pytest.raises(ValueError, match="integer"):
        RingServer.parse("a:1=x")
    assert RingServer.parse("a:1=3") == RingServer("a:1", 3)
    assert RingServer.parse("a:1") == RingServer("a:1", 1)


# -- movement ---------------------------------------------------------------------------


@pytest.mark.parametrize("r", [3, 5, 8])
def test_join_moves_at_most_its_share_and_only_to_the_newcomer(r):
    names = _servers(10 + r, r + 1)
    before = HashRing(names[:r])
    after = before.with_server(names[r])
    after.check_invariants()
    keys = _keys(20 + r, 10_000)
    moved = [k for k in keys if before.owner(k) != after.owner(k)]
    assert all(after.owner(k) == names[r] for k in moved)
    assert len(moved) / len(keys) <= 1 / (r + 1) + 0.04
    assert len(moved) > 0


@pytest.mark.parametrize("r", [3, 5, 8])
def test_leave_moves_only_the_leavers_keys_to_their_next_point(r):
    names = _servers(30 + r, r)
    ring = HashRing(names)
    gone = names[r // 2]
    smaller = ring.without_server(gone)
    smaller.check_invariants()
    keys = _keys(40 + r, 10_000)
    moved = [k for k in keys if ring.owner(k) != smaller.owner(k)]
    assert all(ring.owner(k) == gone for k in moved)
    assert {k for k in keys if ring.owner(k) == gone} == set(moved)
    assert len(moved) / len(keys) <= 1 / r + 0.04
    # Each moved key goes to the next usable ring point, i.e. its first successor.
    assert all(smaller.owner(k) == ring.successors(k)[1] for k in moved)


def test_down_server_is_skipped_and_equals_removal():
    names = _servers(50, 4)
    ring = HashRing(names)
    down = names[1]
    usable = [n for n in names if n != down]
    smaller = ring.without_server(down)
    for key in _keys(51, 3000):
        picked = ring.lookup(key, usable)
        assert picked != down
        assert picked == smaller.owner(key)
        if ring.owner(key) != down:
            assert picked == ring.owner(key)
    # A predicate works as well as a collection.
    assert ring.lookup("k", lambda n: n != down) == ring.lookup("k", usable)
    assert ring.lookup("k", []) is None


def test_nginx_gives_up_after_20_skipped_points():
    names = _servers(60, 30)
    ring = HashRing(names)
    alive = names[7]
    saw_fallback = False
    for key in _keys(61, 2000):
        walked = 0
        for name in ring.walk(key):
            if name == alive:
                break
            walked += 1
        expected = alive if walked <= 20 else None
        assert ring.nginx_pick(key, [alive]) == expected
        assert ring.lookup(key, [alive]) == alive
        saw_fallback |= expected is None
    assert saw_fallback


def test_weights_scale_the_share_of_keys():
    names = _servers(70, 3)
    weights = [1, 3, 6]
    ring = HashRing([RingServer(n, w) for n, w in zip(names, weights)])
    share = Counter(ring.owner(k) for k in _keys(71, 10_000))
    for n, w in zip(names, weights):
        assert abs(share[n] / 10_000 - w / 10) < 0.06


def test_successors_are_distinct_in_ring_order():
    names = _servers(80, 6)
    ring = HashRing(names)
    for key in _keys(81, 200):
        succ = ring.successors(key)
        assert sorted(succ) == sorted(names)
        assert succ[0] == ring.owner(key)
        first_seen = list(dict.fromkeys(ring.walk(key)))
        assert succ == first_seen
        assert ring.successors(key, usable=succ[1:], limit=2) == succ[1:3]


# -- bounded loads ------------------------------------------------------------------------


def test_capacity_formula_is_exact():
    assert bounded_capacity(9, 4, 0.25) == math.ceil(1.25 * 10 / 4) == 4
    # (1 + 0.1) * 10 / 11 is exactly 1; floating point would say 1.0000000000000002.
    assert bounded_capacity(9, 11, 0.1) == 1
    assert bounded_capacity(0, 3, 0.0) == 1
    with pytest.raises(ValueError, match="epsilon"):
        bounded_capacity(1, 1, -0.1)
    with pytest.raises(ValueError, match="replica"):
        bounded_capacity(1, 0, 0.1)


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.25, 1.0])
def test_bounded_lookup_never_exceeds_capacity(epsilon):
    rng = random.Random(int(epsilon * 100) + 90)
    names = _servers(91, 6)
    ring = HashRing(names)
    hot = _keys(92, 5)
    cold = _keys(93, 500)
    live: list[tuple[str, str]] = []  # (key, replica) in flight
    loads = Counter()
    for _ in range(4000):
        if live and rng.random() < 0.45:
            _, rep = live.pop(rng.randrange(len(live)))
            loads[rep] -= 1
            continue
        key = rng.choice(hot) if rng.random() < 0.6 else rng.choice(cold)
        cap = bounded_capacity(sum(loads.values()), len(names), epsilon)
        rep = ring.bounded_lookup(key, loads, epsilon)
        assert loads[rep] < cap
        # It is the first ring successor under capacity.
        assert rep == next(s for s in ring.successors(key) if loads[s] < cap)
        loads[rep] += 1
        live.append((key, rep))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_dominant_prefix_spreads_over_ceil_load_over_capacity(seed):
    rng = random.Random(seed)
    r = rng.randint(4, 10)
    epsilon = rng.choice([0.1, 0.25, 0.5])
    names = _servers(100 + seed, r)
    ring = HashRing(names)
    load = rng.randint(3 * r, 12 * r)
    # A closed loop: `load` requests of one hot key always in flight; one finishes,
    # the next arrives. The capacity seen by each arrival is that of n = load - 1.
    placed: list[str] = []
    loads = Counter()
    for _ in range(load):
        rep = ring.bounded_lookup("hot", loads, epsilon)
        placed.append(rep)
        loads[rep] += 1
    cap = bounded_capacity(load - 1, r, epsilon)
    for _ in range(60 * load):
        done = placed.pop(rng.randrange(len(placed)))
        loads[done] -= 1
        rep = ring.bounded_lookup("hot", loads, epsilon)
        assert loads[rep] < cap
        placed.append(rep)
        loads[rep] += 1
    used = {n for n, c in loads.items() if c > 0}
    need = math.ceil(load / cap)
    assert len(used) == need
    # They are the key's first ring successors: the hot prefix is cached there and only there.
    assert used == set(ring.successors("hot")[:need])


def test_bounded_lookup_skips_unusable_and_ignores_their_load():
    names = _servers(110, 3)
    ring = HashRing(names)
    owner = ring.owner("k")
    others = [n for n in names if n != owner]
    # The owner is down: its (stale) load does not count toward n, R is 2.
    assert ring.bounded_lookup("k", {owner: 100}, 0.25, usable=others) == ring.lookup("k", others)
    assert ring.bounded_lookup("k", {}, 0.25, usable=[]) is None


# -- prefixserve route ----------------------------------------------------------------------


def test_route_cli_prints_key_owner_and_fallbacks(capsys):
    import json

    from prefixserve.router import cli
    from prefixserve.router.routing_key import prefix_hash

    replicas = ["127.0.0.1:18001", "127.0.0.1:18002=2", "127.0.0.1:18003"]
    argv = ["route", *sum((["--replica", r] for r in replicas), []), "--system", "You are terse.", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    ring = HashRing([RingServer.parse(r) for r in replicas])
    key = prefix_hash("You are terse.")
    assert out["key"] == key and out["crc32"] == key_hash(key)
    assert out["replica"] == out["owner"] == ring.owner(key)
    assert out["successors"] == ring.successors(key)

    # The nginx vectors, with the owner marked down: the next successor answers.
    argv = ["route", *sum((["--replica", r] for r in replicas), []), "--key", "tenant-1", "--down", "127.0.0.1:18003"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "X-Prefix-Hash: tenant-1" in text and "ring owner:    127.0.0.1:18003" in text
    assert f"replica:       {ring.successors('tenant-1')[1]}" in text

    assert cli.main(["route", "--replica", "a:1", "--key", "bad key"]) == 2
    assert "visible ASCII" in capsys.readouterr().err
    assert cli.main(["route", "--replica", "a:1", "--key", "k", "--down", "b:1"]) == 2


def test_route_cli_prints_the_key_the_router_uses_and_no_key_for_an_empty_system_prompt(capsys):
    import json

    from prefixserve.router import cli
    from prefixserve.router.routing_key import routing_key

    for system, salt in (("You are terse.", None), ("You are terse.", "tenant"), ("", None), ("", "tenant")):
        body = {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}],
            **({"cache_salt": salt} if salt else {}),
        }
        expected = routing_key(body)
        argv = ["route", "--replica", "a:1", "--system", system, "--json", *(["--cache-salt", salt] if salt else [])]
        assert cli.main(argv) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["key"] == expected and out["affinity"] == (expected is not None), (system, salt, out)
    # An empty static prefix has no affinity: the text says so and prints no key.
    assert cli.main(["route", "--replica", "a:1", "--system", ""]) == 0
    text = capsys.readouterr().out
    assert "no affinity" in text and "X-Prefix-Hash" not in text


@pytest.mark.parametrize("seed", range(6))
def test_the_distance_table_orders_servers_as_the_walk_does(seed: int) -> None:
    # Rings of every size and weight mix, asked through the table and through the point walk
    # (the path of rings too big for a table): the same servers in the same order.
    rng = random.Random(seed)
    servers = [
        RingServer(f"10.{seed}.{i}.{rng.randrange(256)}:80{i}", rng.choice([1, 1, 2, 5]))
        for i in range(rng.choice([1, 2, 3, 7, 16, 40]))
    ]
    table, walk = HashRing(servers), HashRing(servers)
    walk._distances_too_big = True
    for _ in range(300):
        key = f"{rng.getrandbits(64):016x}"
        assert table.order(key) == walk.order(key) == tuple(walk.successors(key))
        assert table.successors(key, limit=3) == walk.successors(key, usable=lambda _n: True, limit=3)
    assert table._distances is not None and walk._distances is None
