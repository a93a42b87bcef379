"""The engine's vLLM-format KV-event publisher: a ZMQ PUB socket and a replay ROUTER socket.

Job: send each engine step's block events (replica/kv/event_recorder.py) as one
``KVEventBatch`` in vLLM 0.32's frames (replica/contract/vllm_kv_events.py), so llm-d,
Dynamo, vllm-router's ``kv_aware`` and our own router/kv_index/ can follow this replica's
cache as they follow a vLLM server's. Configured by ``--kv-events-config`` (vLLM's JSON).

One thread owns both sockets (ZMQ sockets are not thread-safe): it sends the batches the
engine queued, numbering them from 0, keeps the last ``buffer_steps`` for replay, and
answers replay requests between sends. The engine thread neither encodes nor waits:
``publish`` puts the batch on a bounded queue (``max_queue_size``). If that queue is
full (the sending thread stalled) the batch is dropped and the next one sent starts with
``AllBlocksCleared``, so a consumer forgets this replica's blocks instead of trusting a view
with holes. PUB drops frames for a subscriber past ``hwm`` queued ones; that subscriber sees
a gap in ``seq`` and asks the replay socket.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from prefixserve.replica.contract.vllm_kv_events import (
    END_SEQ,
    AllBlocksCleared,
    KVEvent,
    KVEventBatch,
    KVEventsConfig,
    encode_batch,
    encode_seq,
)

log = logging.getLogger(__name__)

# How long the sending thread waits on its queue before looking at the replay socket again.
_POLL_S = 0.05


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard, ipc or inproc address; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    """Sends KV event batches on a PUB socket with a replay buffer (the module docstring)."""

    def __init__(
        self, config: KVEventsConfig, data_parallel_rank: int = 0, context: zmq.Context[Any] | None = None
    ) -> None:
        if not config.enabled:
            raise ValueError("the KV events config does not enable the zmq publisher")
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._ctx = context if context is not None else zmq.Context.instance()
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._lost = False  # a batch was dropped: the next one queued starts with AllBlocksCleared
        self.dropped = 0  # batches dropped on a full queue
        self.sent = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> bool:
        """Queue one step's events as a batch; False (and the batch dropped) when the queue is full.

        Called from one thread (the engine's): the drop flag is that thread's.
        """
        if not self._running:
            return False
        # After a dropped batch the consumers' view has a hole only a reset mends; set here, on the
        # publishing thread, so it lands on the first batch queued after the drop, not on one before.
        listed: list[KVEvent] = [AllBlocksCleared(), *events] if self._lost else list(events)
        batch = KVEventBatch(
            ts=time.time() if ts is None else ts, events=listed, data_parallel_rank=self.data_parallel_rank
        )
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            self._lost = True
            return False
        self._lost = False
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (within ``timeout_s``), stop the thread, close the sockets. Idempotent."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.warning("the KV event publisher thread did not stop within %.1f s", timeout_s)
            return  # its sockets stay open: closing them under a live thread is undefined
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # --- the sending thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError as exc:
                    log.warning("KV event replay failed: %r", exc)
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                self._send(batch)
            except zmq.ZMQError as exc:  # the next batch is still tried: one failed send is one gap
                log.warning("KV event publish failed: %r", exc)

    def _send(self, batch: KVEventBatch) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(batch)
        # Buffered before the send: a subscriber that sees a gap may ask for it at once.
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, encode_seq(seq), payload), copy=False)
        self.sent += 1

    def _serve_replay(self) -> None:
        """Answer one replay request: every buffered batch from its start seq on, then the end marker."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, encode_seq(seq), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
