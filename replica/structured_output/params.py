"""StructuredOutputsParams: the one constraint a request's output must follow (vLLM's name and fields).

Plain data, no grammar library: front ends build it from ``response_format``,
``structured_outputs`` or the older ``guided_*`` fields, and tool calling builds it from
the tools' argument schemas. Exactly one constraint is set; the check here is about
shape only (types, emptiness, size). Whether a schema, regex or grammar is one the
backend can compile is decided by compiling it (``replica/structured_output/compile.py``).
"""

from __future__ import annotations

import hashlib
import json as _json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

# A spec is hashed, compiled and held in the grammar cache: bound its size so one request
# cannot make the front end hash or compile megabytes.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256

# The constraint kinds, in vLLM's field order.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Whitespace characters a JSON constraint allows between two tokens of the structure.
MAX_JSON_WHITESPACE = 8


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's ``StructuredOutputsParams``).

    ``json``: a JSON schema (a dict, or its JSON text); ``regex``: a regular expression
    the whole output matches; ``choice``: the output is one of these strings; ``grammar``:
    an EBNF/GBNF grammar (xgrammar's dialect, root rule ``root``); ``json_object``: any
    JSON object (OpenAI's ``{"type": "json_object"}``); ``structural_tag``: xgrammar's
    structural tag, as JSON text. Exactly one must be set (``json_object`` counts as set
    only when True); a ``ValueError`` names what is wrong otherwise.
    ``disable_any_whitespace`` (vLLM's option): JSON without whitespace between tokens;
    otherwise whitespace is allowed but bounded per gap (``MAX_JSON_WHITESPACE``), so a
    model cannot fill ``max_tokens`` with newlines inside a structure.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if self._is_set(k)]
        if len(set_kinds) != 1:
            if not set_kinds:
                raise ValueError("structured_outputs must set one of " + ", ".join(KINDS))
            raise ValueError("only one kind of structured outputs constraint may be set, got " + ", ".join(set_kinds))
        kind = set_kinds[0]
        if kind == "json":
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
                if not isinstance(parsed, (dict, bool)):
                    raise ValueError("structured_outputs.json must be a JSON schema object")
            elif not isinstance(self.json, dict):
                raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        elif kind == "choice":
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or any(not isinstance(c, str) for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice may have at most {MAX_CHOICES} entries")
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError("structured_outputs.json_object must be true")
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} may have at most {MAX_SPEC_CHARS} characters")

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        if kind == "json_object":
            return value is not None and value is not False
        return value is not None

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``KINDS``."""
        return next(k for k in KINDS if self._is_set(k))

    @cached_property
    def spec(self) -> str:
        """The constraint as compact text: what is compiled and hashed."""
        kind = self.kind
        if kind == "json":
            value = _json.loads(self.json) if isinstance(self.json, str) else self.json
            # Key order is kept: a schema's property order is the order the output follows.
            return _json.dumps(value, separators=(",", ":"))
        if kind == "choice":
            return _json.dumps(list(self.choice or ()), separators=(",", ":"))
        if kind == "json_object":
            return ""
        return str(getattr(self, kind))

    @cached_property
    def key(self) -> str:
        """A hash of (kind, spec): the grammar cache's key."""
        options = "compact" if self.disable_any_whitespace else ""
        return hashlib.sha256(f"{self.kind}\0{options}\0{self.spec}".encode()).hexdigest()
