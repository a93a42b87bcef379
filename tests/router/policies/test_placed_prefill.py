"""``placed`` weighs a later turn's history against the prefill work queued where it is held."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from prefixserve.router.policies import KIND_HISTORY, KIND_SHORTER_PREFILL, Placed, pending_prefill_of
from prefixserve.router.routing_key import prefix_hash

HOLDER, OTHER = "10.0.0.1:8000", "10.0.0.2:8000"
KEY = prefix_hash("the app's system prompt")
STATIC = [bytes([1, i]) for i in range(4)]  # the key's static prefix: 4 blocks
EARLIER = STATIC + [bytes([2, i]) for i in range(3)]  # a conversation's earlier turn: 3 blocks of its own
LATER = EARLIER + [bytes([3, i]) for i in range(2)]  # its next turn: 2 more


@dataclass(frozen=True)
class View:
    name: str
    in_flight: int
    pending_prefill_blocks: int = 0


@dataclass(frozen=True)
class PlainView:
    name: str
    in_flight: int


class Clock:
    def __call__(self) -> float:
        return 0.0


def policy(**options: object) -> Placed:
    """``placed`` whose history index says HOLDER holds EARLIER and OTHER the static prefix alone."""
    p = Placed(clock=Clock(), **options)
    assert p.history is not None
    p.history.record(HOLDER, EARLIER)
    p.history.record(OTHER, STATIC)
    return p


def later_turn(p: Placed, pending_on_holder: int, pending_on_other: int = 0) -> tuple[str, str | None, int | None]:
    views = [View(HOLDER, 1, pending_on_holder), View(OTHER, 1, pending_on_other)]
    d = p.rank(views, KEY, history=LATER, static_blocks=len(STATIC))
    return d.chosen.name, d.kind, d.predicted_blocks


def test_a_later_turn_leaves_its_holder_when_the_prefill_queued_there_outweighs_its_history() -> None:
    # On the holder it computes 2 blocks behind 4 queued (6); elsewhere 5 behind none (5).
    assert later_turn(policy(), pending_on_holder=4) == (OTHER, KIND_SHORTER_PREFILL, len(STATIC))
    # The history it left behind no longer decides: the next turn follows it to where it went.
    p = policy()
    later_turn(p, pending_on_holder=4)
    nxt = LATER + [bytes([4, 0])]
    d = p.rank([View(HOLDER, 1), View(OTHER, 1)], KEY, history=nxt, static_blocks=len(STATIC))
    assert (d.chosen.name, d.kind) == (OTHER, KIND_HISTORY)


@pytest.mark.parametrize(
    ("pending_on_holder", "pending_on_other"),
    [(0, 0), (3, 0), (6, 3), (10, 9)],  # never cheaper elsewhere; a tie stays with the holder
)
def test_a_later_turn_stays_on_its_holder_unless_its_prefill_starts_sooner_elsewhere(
    pending_on_holder: int, pending_on_other: int
) -> None:
    assert later_turn(policy(), pending_on_holder, pending_on_other) == (HOLDER, KIND_HISTORY, len(EARLIER))


def test_the_weight_prices_each_block_to_recompute() -> None:
    # Weight 2: elsewhere costs 2 x 5 = 10, the holder 6 + 2 x 2 = 10; a tie stays.
    assert later_turn(policy(recompute_weight=2.0), pending_on_holder=6)[0] == HOLDER
    assert later_turn(policy(recompute_weight=2.0), pending_on_holder=7)[0] == OTHER
    assert later_turn(policy(recompute_weight=None), pending_on_holder=100)[0] == HOLDER


def test_a_replica_without_the_keys_static_prefix_is_no_alternative() -> None:
    p = Placed(clock=Clock())
    assert p.history is not None
    p.history.record(HOLDER, EARLIER)  # the other replica holds nothing of the key
    assert later_turn(p, pending_on_holder=100)[0] == HOLDER


def test_a_host_that_reports_no_pending_prefill_keeps_the_holder() -> None:
    p = policy()
    d = p.rank([PlainView(HOLDER, 1), PlainView(OTHER, 1)], KEY, history=LATER, static_blocks=len(STATIC))
    assert (d.chosen.name, d.kind) == (HOLDER, KIND_HISTORY)


def test_pending_prefill_of_reads_the_optional_attribute() -> None:
    assert pending_prefill_of(View("a", 0, 7)) == 7
    assert pending_prefill_of(PlainView("a", 0)) == 0
    assert pending_prefill_of(View("a", 0, -3)) == 0
    with pytest.raises(ValueError, match="recompute_weight"):
        Placed(recompute_weight=0.0)
