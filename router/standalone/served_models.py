"""Which replica serves which model: the standalone router's index of its replicas' ``/v1/models``.

Job: hold each replica's model list as it last answered it, and answer a request's questions
in one lookup each (which replicas may take a model, whether the model is a LoRA adapter,
whether a replica is a prefixserve one), not by scanning every list per request. The index is
rebuilt when a list changes (a replica read, or forgotten when it comes back from the dead).

Pure Python: no HTTP, no asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ServedModels:
    """Replica -> its ``/v1/models`` entries, and the index derived from them, over ``names`` in order."""

    def __init__(self, names: Sequence[str]) -> None:
        self._names = list(names)
        self._entries: dict[str, list[dict[str, Any]]] = {}
        self._among: dict[str, list[str]] = {}  # model -> those, and those whose list is not read
        self._adapters: set[str] = set()  # models some replica lists with a ``parent``
        self._prefixserve: set[str] = set()  # replicas whose models are prefixserve's

    def __bool__(self) -> bool:
        """Whether any replica's list was read."""
        return bool(self._entries)

    def __contains__(self, replica: object) -> bool:
        """Whether ``replica``'s list was read."""
        return replica in self._entries

    def set(self, replica: str, entries: list[dict[str, Any]]) -> None:
        """``replica``'s entries as it listed them (each a dict with a string ``id``)."""
        self._entries[replica] = entries
        self._index()

    def drop(self, replica: str) -> None:
        """Forget ``replica``'s list (it is read again before it counts)."""
        if self._entries.pop(replica, None) is not None:
            self._index()

    def among(self, model: str) -> list[str] | None:
        """The replicas a request for ``model`` may go to: those that list it, and those whose list the
        router has not read (down, or not answering it yet); None when no replica lists it."""
        return self._among.get(model)

    def is_adapter(self, model: str) -> bool:
        """Whether a replica lists ``model`` as a LoRA adapter (an entry with a ``parent``, as vLLM lists them)."""
        return model in self._adapters

    def speaks_prefixserve(self, replica: str) -> bool:
        """Whether ``replica`` lists its models as prefixserve's (``owned_by``)."""
        return replica in self._prefixserve

    def merged(self) -> list[dict[str, Any]]:
        """Every model some replica serves, once (the first replica's entry), in replica order."""
        seen: dict[str, dict[str, Any]] = {}
        for name in self._names:
            for entry in self._entries.get(name, []):
                seen.setdefault(entry["id"], entry)
        return list(seen.values())

    def _index(self) -> None:
        serving: dict[str, list[str]] = {}  # model -> replicas listing it, in ``names`` order
        self._adapters = set()
        self._prefixserve = set()
        for name in self._names:
            for entry in self._entries.get(name, []):
                listed = serving.setdefault(entry["id"], [])
                if not listed or listed[-1] != name:
                    listed.append(name)
                if entry.get("parent"):
                    self._adapters.add(entry["id"])
                if entry.get("owned_by") == "prefixserve":
                    self._prefixserve.add(name)
        self._among = {
            model: [n for n in self._names if n in listed or n not in self._entries]
            for model, listed in serving.items()
        }
