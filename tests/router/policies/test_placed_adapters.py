"""``placed`` with LoRA adapters: among the replicas it would take alike, those holding the adapter first."""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.router.policies import KIND_SPILL, Placed, ReplicaLoad, holds_adapter, in_flight_cap
from prefixserve.router.routing_key import adapter_key, prefix_hash

NAMES = [f"10.0.0.{i}:8000" for i in range(1, 6)]


@dataclass(frozen=True)
class View:
    name: str
    in_flight: int
    load: ReplicaLoad | None = None


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def views(in_flight: dict[str, int], holding: dict[str, set[str]]) -> list[View]:
    return [View(n, in_flight.get(n, 0), ReplicaLoad(adapters=frozenset(holding.get(n, set())))) for n in NAMES]


def key_for(adapter: str) -> str:
    return adapter_key(prefix_hash(f"system prompt of {adapter}"), adapter)


def test_holds_adapter_reads_the_reported_load() -> None:
    assert holds_adapter(View("a", 0, ReplicaLoad(adapters=frozenset({"x"}))), "x")
    assert not holds_adapter(View("a", 0, ReplicaLoad()), "x")
    assert not holds_adapter(View("a", 0, None), "x")


def test_a_spill_takes_the_first_ring_successor_holding_the_adapter() -> None:
    policy = Placed(clock=Clock())
    key = key_for("lora-3")
    idle = views({}, {})
    owner = policy.rank(idle, key, adapter="lora-3").chosen.name
    order = [v.name for v in policy.rank(idle, key, count=False).ranking]
    assert order[0] == owner
    # The owner is full; its first ring successor lacks the adapter, the second holds it.
    busy = {owner: 50}
    mean = 50 / len(NAMES)
    assert busy[owner] >= in_flight_cap(mean)
    holder = order[2]
    decision = policy.rank(views(busy, {holder: {"lora-3"}}), key, adapter="lora-3")
    assert decision.chosen.name == holder and decision.kind == KIND_SPILL
    # Without the adapter (or with nobody holding it) the spill is the ring's next, as before.
    assert policy.rank(views(busy, {holder: {"lora-3"}}), key).chosen.name == order[1]
    assert policy.rank(views(busy, {holder: {"other"}}), key, adapter="lora-3").chosen.name == order[1]


def test_a_hot_keys_copies_prefer_the_replica_holding_the_adapter() -> None:
    clock = Clock()
    policy = Placed(clock=clock, rebalance_interval_s=1.0)
    key = key_for("lora-hot")
    idle = views({}, {})
    # All of the traffic on one key: the rebalance gives it copies.
    for _ in range(400):
        clock.t += 0.01
        policy.rank(idle, key, adapter="lora-hot")
        policy.done(key)
    placement = policy.placement(key)
    assert len(placement) >= 2, placement
    second = placement[1]
    # Both under the cap and equally loaded: the one holding the adapter wins every time.
    chosen = {policy.rank(views({}, {second: {"lora-hot"}}), key, adapter="lora-hot").chosen.name for _ in range(6)}
    assert chosen == {second}
    # Nobody holds it: the copies share the traffic in turn, as before.
    chosen = {policy.rank(idle, key, adapter="lora-hot").chosen.name for _ in range(6)}
    assert len(chosen) >= 2


def test_a_replica_holding_the_adapter_over_the_cap_is_not_taken() -> None:
    policy = Placed(clock=Clock())
    key = key_for("lora-5")
    idle = views({}, {})
    owner = policy.rank(idle, key, adapter="lora-5").chosen.name
    order = [v.name for v in policy.rank(idle, key, count=False).ranking]
    full = {owner: 50, order[2]: 50}
    decision = policy.rank(views(full, {order[2]: {"lora-5"}}), key, adapter="lora-5")
    assert decision.chosen.name == order[1]


def test_a_key_whose_replicas_lack_its_adapter_goes_where_it_is_held() -> None:
    policy = Placed(clock=Clock())
    key = key_for("lora-7")
    idle = views({}, {})
    order = [v.name for v in policy.rank(idle, key, count=False).ranking]
    holder = order[3]
    decision = policy.rank(views({}, {holder: {"lora-7"}}), key, adapter="lora-7")
    assert decision.chosen.name == holder and decision.kind == KIND_SPILL
    # The key's own replica holding it too: it stays.
    both = views({}, {holder: {"lora-7"}, order[0]: {"lora-7"}})
    assert policy.rank(both, key, adapter="lora-7").chosen.name == order[0]


def test_a_key_whose_replica_is_full_of_other_adapters_goes_to_one_with_room() -> None:
    policy = Placed(clock=Clock())
    key = key_for("lora-9")
    idle = views({}, {})
    order = [v.name for v in policy.rank(idle, key, count=False).ranking]

    def fleet(held: dict[str, set[str]], capacity: int) -> list[View]:
        return [
            View(n, 0, ReplicaLoad(adapters=frozenset(held.get(n, set())), adapter_capacity=capacity)) for n in NAMES
        ]

    full = {order[0]: {"a", "b"}, order[1]: {"c", "d"}, order[2]: {"e"}}
    assert policy.rank(fleet(full, 2), key, adapter="lora-9").chosen.name == order[2]
    # With room on its own replica (or no capacity reported) the key stays placed.
    assert policy.rank(fleet(full, 3), key, adapter="lora-9").chosen.name == order[0]
    assert policy.rank(fleet(full, 0), key, adapter="lora-9").chosen.name == order[0]
