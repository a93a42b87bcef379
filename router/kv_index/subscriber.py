"""The ZMQ side of the KV-event index: SUB sockets on replicas' publishers, replay on a gap.

Job: feed ``KVEventIndex`` (router/kv_index/index.py) from vLLM-format publishers (vLLM
servers started with ``--kv-events-config``, or our replicas with the same flag). One
thread owns every socket: a SUB per source (so each frame's replica is known), polled
together. Each frame ``[topic, seq, payload]`` goes through the ``SequenceTracker``:

* the next seq: decoded and applied;
* a gap (seq past the next, or a first frame past 0): the missing batches are asked of the
  source's replay socket (a DEALER, ``[b"", start_seq]``, answered up to the end marker
  within ``replay_timeout_s``) and applied in order, then this one. If the replay cannot
  cover the gap (no replay endpoint, a timeout, its buffer already past the start) the
  replica is forgotten and the index restarts from the latest batches it could get: holes
  would make it over-claim;
* a seq at or below the last (the publisher restarted, counting from 0): the replica is
  forgotten, then the frame applied.

Payloads decode in vLLM 0.32's layout or the array layout of older releases. A frame that is
not three parts, a seq that is not 8 bytes, or a payload that does not
decode is counted and skipped; a payload that fails to decode still advances the sequence
as a loss (the replica is forgotten: its events are unknown). Frames over
``max_frame_bytes`` are refused by ZMQ itself. Nothing a publisher sends can stop the
thread or grow the index past its bound.

While a replay is awaited, the other sources' frames wait in their sockets (bounded by
ZMQ's high-water mark, ``rcvhwm``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from prefixserve.replica.contract.vllm_kv_events import END_SEQ, decode_any_batch, decode_seq
from prefixserve.router.kv_index.index import KVEventIndex, SequenceTracker, Verdict

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventSource:
    """One replica's publisher: its name in the index, the PUB address to connect to (a bound
    wildcard such as ``tcp://*:5557`` must be given as the host's address), its replay
    address if it has one, and the topic to subscribe to (``""``: every topic)."""

    replica: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass
class SubscriberStats:
    frames: int = 0
    malformed: int = 0  # frames skipped: wrong shape, bad seq, undecodable payload
    gaps: int = 0
    replayed: int = 0  # batches applied from a replay
    replay_failures: int = 0  # gaps the replay could not fill (the replica forgotten)
    restarts: int = 0


class ZmqKVEventSubscriber:
    """Applies every source's batches to ``index`` on a thread of its own; ``start``/``stop``."""

    def __init__(
        self,
        sources: Sequence[EventSource],
        index: KVEventIndex,
        *,
        context: zmq.Context[Any] | None = None,
        replay_timeout_s: float = 2.0,
        max_frame_bytes: int = 64 * 1024 * 1024,
        rcvhwm: int = 100_000,
    ) -> None:
        names = [s.replica for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"each source needs its own replica name, got {names}")
        self.sources = list(sources)
        self.index = index
        self.tracker = SequenceTracker()
        self.stats = SubscriberStats()
        self.replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self.max_frame_bytes = max_frame_bytes
        self.rcvhwm = rcvhwm
        self._ctx = context if context is not None else zmq.Context.instance()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ZmqKVEventSubscriber:
        if self._thread is not None:
            raise RuntimeError("the subscriber is already started")
        sockets: dict[zmq.Socket[bytes], EventSource] = {}
        try:
            for source in self.sources:
                sock = self._ctx.socket(zmq.SUB)
                sockets[sock] = source
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
                sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
                sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode("utf-8"))
                sock.connect(source.endpoint)
        except zmq.ZMQError:
            for sock in sockets:
                sock.close(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, args=(sockets,), name="kv-event-subscriber", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (it closes its sockets). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    # --- the thread ----------------------------------------------------------------

    def _run(self, sockets: dict[zmq.Socket[bytes], EventSource]) -> None:
        poller = zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        continue
                    try:
                        self.handle(sockets[sock], frames)
                    except Exception:  # noqa: BLE001 - one bad frame must not end the index's feed
                        self.stats.malformed += 1
                        log.exception("KV event frame from %s failed", sockets[sock].replica)
        finally:
            for sock in sockets:
                sock.close(linger=0)

    def handle(self, source: EventSource, frames: Sequence[bytes]) -> None:
        """One live frame of ``source`` (the module docstring's rules)."""
        self.stats.frames += 1
        if len(frames) != 3:
            self.stats.malformed += 1
            return
        try:
            seq = decode_seq(frames[1])
        except ValueError:
            self.stats.malformed += 1
            return
        if seq < 0:
            self.stats.malformed += 1
            return
        replica = source.replica
        verdict = self.tracker.check(replica, seq)
        if verdict is Verdict.RESTART:
            self.stats.restarts += 1
            self.index.forget(replica)
            self.tracker.forget(replica)
        elif verdict is Verdict.GAP:
            self.stats.gaps += 1
            self._fill_gap(source, self.tracker.expected(replica), seq)
        self._apply(replica, seq, frames[2])

    def _apply(self, replica: str, seq: int, payload: bytes) -> bool:
        self.tracker.applied(replica, seq)
        try:
            batch = decode_any_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats.malformed += 1
            self.index.forget(replica)  # this batch's events are unknown: what the index holds may be stale
            return False
        self.index.apply(replica, batch)
        return True

    def _fill_gap(self, source: EventSource, start: int, stop: int) -> None:
        """Apply ``source``'s batches ``start .. stop-1`` from its replay socket. When it cannot give
        them all, the replica is forgotten and only the run it gave that ends at ``stop-1`` is applied:
        applied to nothing, a run of batches never over-claims (a block stored before it is merely
        unknown), while missing batches in the middle could hide a removal."""
        payloads = self._fetch_replay(source, start, stop)
        first = stop
        while first - 1 in payloads:
            first -= 1
        if first != start:
            self.stats.replay_failures += 1
            self.index.forget(source.replica)
        for seq in range(first, stop):
            self._apply(source.replica, seq, payloads[seq])  # an undecodable one forgets the replica too
            self.stats.replayed += 1

    def _fetch_replay(self, source: EventSource, start: int, stop: int) -> dict[int, bytes]:
        """The payloads of ``source``'s buffered batches ``start .. stop-1`` by seq (what its replay
        socket holds of them; none without one, or when it fails or times out)."""
        got: dict[int, bytes] = {}
        if source.replay_endpoint is None:
            return got
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sock.setsockopt(zmq.RCVTIMEO, self.replay_timeout_ms)
        try:
            sock.connect(source.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    return {}
                if frames[2] == END_SEQ:
                    return got
                seq = decode_seq(frames[2])
                if start <= seq < stop:
                    got[seq] = frames[3]
        except (zmq.ZMQError, ValueError) as exc:  # zmq.Again on the timeout
            log.warning("KV event replay from %s failed: %r", source.replica, exc)
            return {}
        finally:
            sock.close(linger=0)
