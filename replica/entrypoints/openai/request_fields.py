"""Unknown request fields: accepted and ignored as vLLM does, or refused on a strict server.

Job: decide what happens to the top-level fields of a request body that its request model
does not declare. vLLM's protocol models accept them (``extra="allow"``) and log them as
ignored, and routers rely on that: vllm-router re-serialises every chat request with
SGLang's fields (``no_stop_trim``, ``separate_reasoning``, ``return_hidden_states``, ...).
So by default such a field is dropped before validation, named once in the log (the first
time any request sends it, not once per request) and counted per request in
``prefixserve:ignored_request_fields_total{field}``. ``strict`` keeps them: validation then
refuses the request (400 ``unknown_parameter``, the field named), the behaviour for those
who would rather see a typo fail.

Invariants:
* Only unknown *top-level* keys are dropped; a declared field with a bad value, a field
  vLLM implements and this engine does not (declared in protocol.py and refused when
  it would change the answer) and an unknown key inside a nested object stay 400s.
* The distinct field names remembered (for the log and as metric labels) are bounded
  (``max_names``): a client sending random keys can neither grow memory nor the
  metric's label set; names past the bound count as ``OTHER_FIELD`` and are logged once
  together.

Pure logic: no HTTP framework, Ray or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

log = logging.getLogger(__name__)

# Distinct field names remembered; the metric's label values are bounded by it too.
DEFAULT_MAX_NAMES = 64
# The label of every field past the bound.
OTHER_FIELD = "_other"
# A name longer than this is cut in the log and the label (it is the client's text).
MAX_NAME_CHARS = 64


def declared_fields(model: type[BaseModel]) -> frozenset[str]:
    """The top-level keys ``model`` accepts: its field names and their aliases."""
    names = set(model.model_fields)
    names.update(f.alias for f in model.model_fields.values() if f.alias)
    return frozenset(names)


def unknown_fields(model: type[BaseModel], data: Mapping[str, Any]) -> list[str]:
    """The top-level keys of ``data`` that ``model`` does not declare, in the body's order."""
    known = declared_fields(model)
    return [key for key in data if key not in known]


@dataclass
class IgnoredFields:
    """What a front end does with unknown top-level request fields (see the module docstring).

    ``strict``: keep them, so that validation refuses the request. ``count``: called once per
    ignored field of each request with its label (the field's name, or ``OTHER_FIELD``);
    the standalone server counts them in the engine's metrics.
    """

    strict: bool = False
    count: Callable[[str], None] | None = None
    max_names: int = DEFAULT_MAX_NAMES
    _names: set[str] = field(default_factory=set, repr=False)
    _other_logged: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_names < 0:
            raise ValueError(f"max_names must be >= 0, got {self.max_names}")

    def filter(self, model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
        """``data`` without the fields ``model`` does not declare (each logged once, counted);
        ``data`` itself when strict or when it has none."""
        if self.strict:
            return data
        unknown = unknown_fields(model, data)
        if not unknown:
            return data
        for name in unknown:
            label = self._label(name)
            if self.count is not None:
                self.count(label)
        dropped = set(unknown)
        return {k: v for k, v in data.items() if k not in dropped}

    def _label(self, name: str) -> str:
        """The metric label of ``name``, logging the first request that sent it."""
        name = name[:MAX_NAME_CHARS]
        if name in self._names:
            return name
        if len(self._names) < self.max_names:
            self._names.add(name)
            log.warning("request field %r is not a parameter of this server: ignored (as vLLM does)", name)
            return name
        if not self._other_logged:
            self._other_logged = True
            log.warning(
                "request field %r is not a parameter of this server: ignored; %d field names are known, "
                "further ones are counted as %r and not logged",
                name,
                self.max_names,
                OTHER_FIELD,
            )
        return OTHER_FIELD
