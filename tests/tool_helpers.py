"""Tools, a travel question and checks shared by the tool-calling tests against a real server
(one replica, the Ray Serve cluster): argument validation and reassembly of streamed calls."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

SYSTEM = "You are a travel assistant. Use the tools to answer questions about weather and flights."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get tomorrow's weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Lisbon", "Oslo", "Rome", "Paris"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
FLIGHTS = {
    "type": "function",
    "function": {
        "name": "find_flights",
        "description": "Find flights to a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {"type": "string", "enum": ["Lisbon", "Oslo", "Rome", "Paris"]},
                "max_stops": {"type": "integer", "minimum": 0, "maximum": 2},
            },
            "required": ["to", "max_stops"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, FLIGHTS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Will it rain in Lisbon tomorrow?"}]
NAMED = {"type": "function", "function": {"name": "find_flights"}}


def valid_arguments(name: str, arguments: str) -> dict[str, Any]:
    """A call's arguments, parsed and validated against its tool's schema (raises if not)."""
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def streamed_tool_calls(client: Any, **kwargs: Any) -> tuple[list[dict[str, str]], str | None]:
    """The tool calls reassembled from a stream's deltas (OpenAI's shape), and the finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or ():
                if d.id is not None:
                    assert d.index not in calls and d.type == "function" and d.function.name
                    assert d.id.startswith("call_")
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.index in calls and not (d.function.name or "")
                    calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish
