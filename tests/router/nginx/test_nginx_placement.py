"""nginx and the placed policy: placement rendered as a map of salted keys, 429 walks the ring.

Fast tests render; the slow ones run a real nginx in front of backends nginx
itself serves (each answers with its own port; one answers 429) and check
where requests land.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import httpx
import pytest
from nginx_helpers import NGINX, NginxProcess, backends_conf, free_ports, keys_owned, needs_nginx, write_private_config

from prefixserve.router.nginx.config import NginxConfig, PlacementMap, render_config, salted_key
from prefixserve.router.policies import Placed, Replica
from prefixserve.router.ring import HashRing, RingServer
from prefixserve.router.routing_key import PREFIX_HASH_HEADER, prefix_hash

NAMES = ["127.0.0.1:9101", "127.0.0.1:9102", "127.0.0.1:9103"]


def snapshot_for(names: list[str], placements: dict[str, list[str]]) -> dict:
    """A placement snapshot as ``placed`` writes it, with the given placements."""
    return {
        "format": 1,
        "version": 7,
        "members": names,
        "weights": dict.fromkeys(names, 1),
        "keys": {k: {"replicas": r, "rate": 1.0, "work": 0.0} for k, r in placements.items()},
    }


def test_salted_key_lands_on_the_wanted_replica():
    ring = HashRing(NAMES)
    for i in range(200):
        key = prefix_hash(str(i))
        for name in NAMES:
            salted = salted_key(key, name, ring)
            assert ring.owner(salted) == name
            assert (salted == key) == (ring.owner(key) == name)


def test_placement_map_keeps_only_keys_off_their_ring_owner():
    ring = HashRing(NAMES)
    stay, move, hot = keys_owned(ring, NAMES[0], 3)
    snap = snapshot_for(
        NAMES, {stay: [NAMES[0]], move: [NAMES[1]], hot: [NAMES[0], NAMES[2]], "UPPER-Case": [NAMES[1]]}
    )
    pm = PlacementMap.from_snapshot(snap, [RingServer(n) for n in NAMES])
    entries = dict(pm.entries)
    assert set(entries) == {move, hot} and pm.version == 7 and pm.skipped == 1
    assert [ring.owner(s) for s in entries[move]] == [NAMES[1]]
    assert [ring.owner(s) for s in entries[hot]] == [NAMES[0], NAMES[2]]
    text = render_config(NginxConfig(replicas=tuple(RingServer(n) for n in NAMES), placement=pm))
    assert "hash $prefixserve_ring_key consistent;" in text
    assert f"        {move} {entries[move][0]};" in text
    assert 'split_clients "${request_id}" $prefixserve_split_1 {' in text and "50.00%" in text
    with pytest.raises(ValueError, match="not among the replicas"):
        PlacementMap.from_snapshot(snapshot_for(["SERVE_REPLICA::x"], {}), [RingServer(n) for n in NAMES])


def test_a_real_placed_policys_snapshot_renders(tmp_path, capsys):
    """The snapshot of router/policies/placed.py's Placed over the nginx server names, through the CLI."""
    clock = [0.0]
    policy = Placed(clock=lambda: clock[0], rebalance_interval_s=1.0)
    views = [Replica(n) for n in NAMES]
    ring = HashRing(NAMES)
    hot = keys_owned(ring, NAMES[0], 1, seed="hot")[0]
    for i in range(300):  # one hot key among a few cold ones: the rebalance replicates it
        clock[0] += 0.1
        policy.rank(views, hot)
        if i % 10 == 0:
            policy.rank(views, prefix_hash(f"cold-{i}"))
    assert len(policy.placement(hot)) >= 2
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(policy.placement_snapshot()))
    args = ["nginx-config", *(x for n in NAMES for x in ("--replica", n)), "--placement", str(path)]
    from prefixserve.router import cli

    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "$prefixserve_split_" in out and f"        {hot} $prefixserve_split_" in out
    assert cli.main([*args[:-1], str(tmp_path / "missing.json")]) == 2
    assert "cannot read the placement" in capsys.readouterr().err


# -- a real nginx (slow) ------------------------------------------------------------------------


def _nginx_conf(
    tmp_path: Path, front: int, backends: list[int], placement: PlacementMap | None, busy: int | None = None
) -> Path:
    ok = [p for p in backends if p != busy]
    text = backends_conf(ok)
    if (
        busy is not None
    ):  # a replica over its in-flight cap: 429 with Retry-After, as replica/entrypoints/openai/server.py answers
        text += (
            f"server {{\n    listen 127.0.0.1:{busy};\n    location / {{ add_header Retry-After 1 always; "
            f'return 429 \'{{"error":{{"code":"replica_busy"}}}}\'; }}\n}}\n'
        )
    return write_private_config(
        tmp_path,
        front,
        text,
        replicas=tuple(RingServer(f"127.0.0.1:{p}") for p in backends),
        placement=placement,
        max_fails=0,  # keep the busy replica in: every request meets its 429
    )


@needs_nginx
@pytest.mark.slow
def test_real_nginx_sends_a_mapped_key_to_its_placed_replica(tmp_path):
    front, *backends = free_ports(4)
    names = [f"127.0.0.1:{p}" for p in backends]
    ring = HashRing(names)
    moved = keys_owned(ring, names[0], 5, seed="moved")
    hot = keys_owned(ring, names[1], 1, seed="hot")[0]
    plain = keys_owned(ring, names[2], 5, seed="plain")
    placements = {k: [names[1 + i % 2]] for i, k in enumerate(moved)}
    placements[hot] = [names[1], names[0]]
    pm = PlacementMap.from_snapshot(snapshot_for(names, placements), [RingServer(n) for n in names])
    conf = _nginx_conf(tmp_path, front, backends, pm)
    with NginxProcess(NGINX, conf, tmp_path, wait_ports=[front, *backends]):
        with httpx.Client(base_url=f"http://127.0.0.1:{front}", timeout=10) as http:

            def landed(key: str) -> str:
                r = http.get("/v1/models", headers={PREFIX_HASH_HEADER: key})
                assert r.status_code == 200, r.text
                return f"127.0.0.1:{r.text}"

            for k in moved:
                assert landed(k) == placements[k][0] != ring.owner(k)
            for k in plain:  # not in the map: the ring owner, as without a placement
                assert landed(k) == ring.owner(k)
            spread = Counter(landed(hot) for _ in range(60))
    assert set(spread) == {names[0], names[1]} and min(spread.values()) >= 10, spread


@needs_nginx
@pytest.mark.slow
def test_real_nginx_walks_the_ring_past_a_replica_answering_429(tmp_path):
    front, *backends = free_ports(4)
    names = [f"127.0.0.1:{p}" for p in backends]
    ring = HashRing(names)
    busy = backends[0]
    keys = keys_owned(ring, names[0], 10, seed="busy")
    conf = _nginx_conf(tmp_path, front, backends, None, busy=busy)
    with NginxProcess(NGINX, conf, tmp_path, wait_ports=[front, *backends]):
        with httpx.Client(base_url=f"http://127.0.0.1:{front}", timeout=10) as http:
            for k in keys:
                r = http.post("/v1/chat/completions", json={}, headers={PREFIX_HASH_HEADER: k})
                assert r.status_code == 200, r.text
                # The key's next ring replica: where the router spills it too.
                assert f"127.0.0.1:{r.text}" == ring.successors(k)[1]
