"""sglang-router's ``cache_aware`` policy: an approximate prefix tree of routed requests plus a load fallback.

Source: sgl-project/sglang, ``sgl-router/src/policies/cache_aware.rs``
(``CacheAwarePolicy::select_worker``) and ``sgl-router/src/tree.rs``; defaults
from the router's CLI defaults (``cache_threshold 0.3, balance_abs_threshold
64, balance_rel_threshold 1.5, eviction_interval 120 s, max_tree_size
67,108,864``). What this model reproduces:

* the router keeps one radix tree of the requests it has routed, each node
  remembering which workers it was sent to and when (the "approximate tree":
  it never learns what a worker's KV cache evicted);
* load = the router's own count of in-flight requests per worker; the system
  is *imbalanced* when ``max_load - min_load > balance_abs_threshold`` and
  ``max_load > balance_rel_threshold * min_load``: the request goes to the
  least loaded worker (and is still inserted in the tree under it);
* otherwise the request's longest match in the tree is found; when
  ``matched / len(request) > cache_threshold`` it goes to the worker holding
  that match (the most recently used one if several), else to the worker with
  the smallest tree (the most free cache, as the router believes); the tree
  then gets the request inserted under the chosen worker;
* every ``eviction_interval_s`` least-recently-used leaves of workers whose
  tree exceeds ``max_tree_size`` are evicted.

Difference: SGLang matches raw characters; the model matches token ids (any
hashable elements), which changes the granularity, not the policy.

Invariants (``check_invariants``): a replica's size is the total edge length of
the nodes it holds; a node held by no replica is detached; every child's edge
starts with the key it is filed under.

Pure Python: no torch, no Ray, no HTTP.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixserve.router.policies import Decision, ReplicaView, by_load

if TYPE_CHECKING:
    from prefixserve.loadtest.peers import PeerReplica, PeerRequest


class _Node:
    __slots__ = ("edge", "children", "parent", "access")

    def __init__(self, edge: tuple, parent: _Node | None) -> None:
        self.edge = edge
        self.children: dict[Hashable, _Node] = {}
        self.parent = parent
        self.access: dict[str, float] = {}  # replica name -> last time it was routed this prefix


def _common_len(edge: tuple, seq: tuple, pos: int) -> int:
    """Length of the common prefix of ``edge`` and ``seq[pos:]`` (binary search over C slice compares)."""
    lo, hi = 0, min(len(edge), len(seq) - pos)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if edge[:mid] == seq[pos : pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ApproxTree:
    """A multi-tenant radix tree: which replica was sent which prefix, and when."""

    def __init__(self) -> None:
        self.root = _Node((), None)
        self.sizes: dict[str, int] = {}  # replica -> elements held

    def match(self, seq: tuple) -> tuple[int, str | None]:
        """(length of the longest match, a replica holding it: the most recently used)."""
        pos, node = self._walk(seq)
        if node is self.root or not node.access:
            return 0, None
        return pos, max(node.access.items(), key=lambda kv: (kv[1], kv[0]))[0]

    def match_all(self, seq: tuple) -> tuple[int, list[str]]:
        """(length of the longest match, every replica holding the deepest matched node, by name)."""
        pos, node = self._walk(seq)
        if node is self.root or not node.access:
            return 0, []
        return pos, sorted(node.access)

    def _walk(self, seq: tuple) -> tuple[int, _Node]:
        """The matched length and the deepest node reached (partially matched edges count)."""
        node, pos, n = self.root, 0, len(seq)
        while pos < n:
            child = node.children.get(seq[pos])
            if child is None:
                break
            k = len(child.edge)
            if seq[pos : pos + k] == child.edge:
                pos += k
                node = child
                continue
            pos += _common_len(child.edge, seq, pos)
            node = child
            break
        return pos, node

    def _split(self, child: _Node, k: int) -> _Node:
        """Split ``child``'s edge after k elements; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:k], parent)
        upper.access = dict(child.access)
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[k:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def insert(self, seq: tuple, replica: str, now: float) -> None:
        """Record that ``seq`` was routed to ``replica`` at time ``now``."""
        node, pos, n = self.root, 0, len(seq)
        sizes = self.sizes
        while pos < n:
            child = node.children.get(seq[pos])
            if child is None:
                leaf = _Node(seq[pos:], node)
                node.children[seq[pos]] = leaf
                leaf.access[replica] = now
                sizes[replica] = sizes.get(replica, 0) + len(leaf.edge)
                return
            k = len(child.edge)
            if seq[pos : pos + k] != child.edge:
                child = self._split(child, _common_len(child.edge, seq, pos))
                k = len(child.edge)
            if replica not in child.access:
                sizes[replica] = sizes.get(replica, 0) + k
            child.access[replica] = now
            pos += k
            node = child

    def evict(self, replica: str, max_size: int) -> None:
        """Drop ``replica``'s least recently used leaves until it holds at most ``max_size`` elements."""
        if self.sizes.get(replica, 0) <= max_size:
            return
        heap = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if replica in node.access and not any(replica in c.access for c in node.children.values()):
                heap.append((node.access[replica], id(node), node))
        heapq.heapify(heap)
        while heap and self.sizes[replica] > max_size:
            _, _, node = heapq.heappop(heap)
            del node.access[replica]
            self.sizes[replica] -= len(node.edge)
            parent = node.parent
            assert parent is not None
            # Detach nodes nobody holds any more, up the path.
            up = node
            while up is not self.root and not up.access and not up.children:
                assert up.parent is not None
                del up.parent.children[up.edge[0]]
                up = up.parent
            if (
                parent is not self.root
                and replica in parent.access
                and not any(replica in c.access for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.access[replica], id(parent), parent))

    def check_invariants(self) -> None:
        totals: dict[str, int] = {}
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.edge and child.edge[0] == key, "child filed under the wrong key"
                assert child.parent is node, "broken parent link"
                assert child.access or child.children, "a node nobody holds stayed attached"
                stack.append(child)
            for r in node.access:
                totals[r] = totals.get(r, 0) + len(node.edge)
        for r, size in self.sizes.items():
            assert totals.get(r, 0) == size, f"{r}: size {size} but holds {totals.get(r, 0)}"


@dataclass(frozen=True)
class SGLangConfig:
    """sglang-router's cache_aware knobs (its current CLI defaults)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 67_108_864

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.eviction_interval_s <= 0 or self.max_tree_size < 1:
            raise ValueError("eviction_interval_s must be > 0 and max_tree_size >= 1")


class SGLangCacheAware:
    """The policy object: ``route`` ranks replicas for a request's element sequence."""

    name = "sglang_tree"

    def __init__(self, config: SGLangConfig | None = None) -> None:
        self.config = config or SGLangConfig()
        self.tree = ApproxTree()
        self._next_eviction: float | None = None

    def route(self, candidates: Sequence[PeerReplica], request: PeerRequest) -> Decision:
        """The peer interface (loadtest/peers): rank for the request's prompt tokens."""
        return self.choose(candidates, request.tokens, request.now)

    def on_prefilled(self, replica: str, request: PeerRequest) -> None:
        """Nothing: the router learns only what it routed."""

    def on_finish(self, replica: str, request: PeerRequest) -> None:
        """Nothing: its load counter is the caller's in-flight count."""

    def choose(self, candidates: Sequence[ReplicaView], seq: tuple, now: float) -> Decision:
        """Rank ``candidates`` for ``seq`` (best first) and record the choice in the tree."""
        if not candidates:
            raise ValueError("a routing policy needs at least one candidate replica")
        cfg = self.config
        if self._next_eviction is None:
            self._next_eviction = now + cfg.eviction_interval_s
        elif now >= self._next_eviction:
            for c in candidates:
                self.tree.evict(c.name, cfg.max_tree_size)
            self._next_eviction = now + cfg.eviction_interval_s
        ordered = by_load(candidates)
        lo, hi = ordered[0].in_flight, ordered[-1].in_flight
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            chosen = ordered[0]
        else:
            matched, holder = self.tree.match(seq)
            names = {c.name: c for c in candidates}
            if seq and holder in names and matched / len(seq) > cfg.cache_threshold:
                chosen = names[holder]
            else:
                sizes = self.tree.sizes
                chosen = min(candidates, key=lambda c: (sizes.get(c.name, 0), c.in_flight, c.name))
        self.tree.insert(seq, chosen.name, now)
        return Decision([chosen] + [c for c in ordered if c is not chosen])
