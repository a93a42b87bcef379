"""A prefixserve replica's SSE answer relayed whole event by whole event, its progress comments counted.

Job: :class:`ProgressRelay` takes a replica's answer bytes as they arrive and gives back the
events a client may have (whole events only, so a replica that dies mid-event leaves no half event
with the client), with the progress comments (replica/contract/continuation.py) taken out and
counted in a :class:`StreamProgress`: what the client has, from which the router builds the
continuation another replica replays. The replica's in-band error that says it is stopping
(``server_shutting_down``) ends the relay without being relayed: the stream continues elsewhere.

Only answers the router asked progress of go through it (streams of one sequence to a prefixserve
replica); every other answer is relayed byte for byte as it comes. Pure: no HTTP.
"""

from __future__ import annotations

from prefixserve.replica.contract.continuation import PROGRESS_COMMENT, SHUTTING_DOWN_CODE, parse_progress
from prefixserve.router.migration import StreamProgress

_PROGRESS = PROGRESS_COMMENT.encode()
_ERROR_EVENT = b'data: {"error"'
_SHUTTING_DOWN = f'"{SHUTTING_DOWN_CODE}"'.encode()
_EVENT_END = b"\n\n"


class ProgressRelay:
    """The relay of one replica's answer (see the module docstring).

    ``valid`` turns False at a progress comment that does not parse: what the client has is then
    unknown, and the stream no longer moves. ``stopping``: the replica ended the stream while
    stopping (its error event and what follows are not relayed).
    """

    def __init__(self, progress: StreamProgress) -> None:
        self.progress = progress
        self.valid = True
        self.stopping = False
        self._pending = b""

    @property
    def pending(self) -> bytes:
        """Bytes of an event not whole yet."""
        return self._pending

    def feed(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes, progress comments taken out (b"" while none is whole)."""
        if self.stopping:
            return b""
        data = self._pending + chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._pending = data
            return b""
        whole, self._pending = data[: end + 2], data[end + 2 :]
        if _PROGRESS not in whole and _ERROR_EVENT not in whole:
            return whole
        out = []
        for block in whole.split(_EVENT_END)[:-1]:
            if block.startswith(_ERROR_EVENT) and _SHUTTING_DOWN in block:
                self.stopping = True
                self._pending = b""
                break
            kept = []
            for line in block.split(b"\n"):
                if line.startswith(_PROGRESS):
                    self._count(line)
                else:
                    kept.append(line)
            if any(kept):
                out.append(b"\n".join(kept) + _EVENT_END)
        return b"".join(out)

    def _count(self, line: bytes) -> None:
        if not self.valid:
            return
        try:
            self.progress.record_comment(parse_progress(line.decode("utf-8")))
        except (ValueError, UnicodeDecodeError, KeyError, TypeError):
            self.valid = False
