"""What a request's ``tool_choice`` asks of the engine: which parser reads the output, which schema constrains it.

Job, per vLLM's semantics (``serving_chat.py``, ``protocol.py``):

* ``none``: tools are rendered (the template still shows them) but the output is
  plain content; no parser runs.
* ``auto``: the model decides; the server's ``--tool-call-parser`` reads its text.
  Needs ``--enable-auto-tool-choice`` and a parser, else 400 with vLLM's message.
* ``required``: the output is constrained to a JSON array of
  ``{"name": <one of the tools>, "parameters": <that tool's arguments>}`` (one item
  at most when ``parallel_tool_calls`` is false), read by ``RequiredParser``.
* a named function: the output is constrained to that function's parameters
  schema and read as its arguments (``NamedFunctionParser``).

So with ``required`` or a named function the arguments always parse: decoding
follows the schema (``SamplingParams.structured_outputs``).

Pure Python; the request models stay in ``replica/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prefixserve.replica.tool_calling.parsers import NamedFunctionParser, RequiredParser, ToolCallParser, get_parser
from prefixserve.replica.tool_calling.stream import ToolCallStream

# vLLM's answer to tool_choice="auto" on a server not started for it (HTTP 400).
AUTO_TOOL_CHOICE_DISABLED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
EMPTY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCallMode:
    """How the engine host reads one request's output for tool calls.

    ``choice``: "auto" (the server's parser), "required" or "named" (``name``);
    ``parallel``: ``parallel_tool_calls`` (False keeps only the first call).
    """

    choice: Literal["auto", "required", "named"]
    name: str | None = None
    parallel: bool = True

    def parser(self, auto_parser: str | None) -> ToolCallParser:
        """The parser for this mode; ``auto_parser`` is the server's ``--tool-call-parser``."""
        if self.choice == "required":
            return RequiredParser()
        if self.choice == "named":
            assert self.name is not None
            return NamedFunctionParser(self.name)
        if auto_parser is None:
            raise ValueError(AUTO_TOOL_CHOICE_DISABLED)
        return get_parser(auto_parser)

    def new_stream(self, auto_parser: str | None) -> ToolCallStream:
        """A fresh tool-call stream for one sequence of the request."""
        return ToolCallStream(self.parser(auto_parser), self.parallel)


def check_auto_supported(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """Raise ValueError (HTTP 400, vLLM's message) unless this server serves ``tool_choice="auto"``."""
    if not enable_auto_tool_choice or tool_call_parser is None:
        raise ValueError(AUTO_TOOL_CHOICE_DISABLED)


def _hoisted_defs(parameters: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """The ``$defs`` of every tool's parameters, merged (vLLM's rule: one schema per definition name)."""
    out: dict[str, Any] = {}
    for params in parameters:
        for name, schema in (params or {}).get("$defs", {}).items():
            if name in out and out[name] != schema:
                raise ValueError(
                    f"tool definition {name!r} has more than one schema in $defs, which is not "
                    "supported with tool_choice='required'"
                )
            out[name] = schema
    return out


def required_schema(tools: Sequence[tuple[str, dict[str, Any] | None]], parallel: bool = True) -> dict[str, Any]:
    """vLLM's JSON schema for ``tool_choice="required"``: an array of ``{"name", "parameters"}`` calls.

    ``tools``: (name, parameters schema or None) per tool. ``$defs`` of the tools'
    schemas move to the top level, where their ``#/$defs/...`` references point.
    """
    variants = []
    for name, params in tools:
        body = copy.deepcopy(params) if params else dict(EMPTY_OBJECT_SCHEMA)
        body.pop("$defs", None)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": body},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    defs = _hoisted_defs([p for _, p in tools])
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema of a named function's output: its parameters (an empty object when it has none)."""
    return copy.deepcopy(parameters) if parameters else dict(EMPTY_OBJECT_SCHEMA)
