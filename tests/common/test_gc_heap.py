"""freeze_gc_heap: garbage collected first, every live object then out of the collector's reach.

Run in a child process: freezing the test process's heap would keep every later test's cycles."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import gc, weakref
from prefixserve.common.gc_heap import freeze_gc_heap

class Node:
    pass

cycle = Node()
cycle.self = cycle
dead = weakref.ref(cycle)
del cycle
kept = [Node() for _ in range(1000)]
gc.disable()  # nothing but the call collects
freeze_gc_heap()
assert dead() is None, "garbage alive before the call was not collected"
assert gc.get_freeze_count() >= len(kept), gc.get_freeze_count()
gc.enable()
print("ok")
"""


def test_garbage_is_collected_and_the_live_heap_frozen() -> None:
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
