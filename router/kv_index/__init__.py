"""KV-aware routing over vLLM-format KV events: which replicas hold which blocks.

* index.py: ``KVEventIndex`` (block hash -> replicas per medium, bounded; ``apply(replica, batch)``,
  ``longest_prefix(block_hashes) -> {replica: blocks}``) and ``SequenceTracker`` (gaps, restarts);
* subscriber.py: ``ZmqKVEventSubscriber(sources, index).start() / .stop()``, SUB sockets on the
  replicas' publishers, the replay socket asked on a gap;
* vllm_hashes.py: ``vllm_block_hashes``, a request's block hashes as a vLLM server computes them
  (``sha256_cbor``), to look up in the index. A prefixserve replica publishes its own Contract-2
  hashes instead: look those up with replica/kv/hashing.py's ``hash_blocks`` (the replica's
  algorithm, seed and block size); the index reads bytes digests and ints alike.

The wire format is replica/contract/vllm_kv_events.py. Use::

    index = KVEventIndex(max_entries=1_000_000)
    sub = ZmqKVEventSubscriber(
        [EventSource("r0", "tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558")], index
    ).start()
    hits = index.longest_prefix(vllm_block_hashes(token_ids, block_size=16))  # {"r0": 3}
    sub.stop()
"""

from prefixserve.router.kv_index.index import KVEventIndex, SequenceTracker, Verdict
from prefixserve.router.kv_index.subscriber import EventSource, ZmqKVEventSubscriber
from prefixserve.router.kv_index.vllm_hashes import vllm_block_hashes

__all__ = ["EventSource", "KVEventIndex", "SequenceTracker", "Verdict", "ZmqKVEventSubscriber", "vllm_block_hashes"]
