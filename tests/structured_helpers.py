"""Seeded JSON schemas for structured-output tests and benchmarks (nested objects, arrays, enums,
bounded numbers, patterned strings, optional fields), each bounded so that an answer is short."""

from __future__ import annotations

import random
from typing import Any

WORDS = ("red", "green", "blue", "small", "large", "north", "south", "alpha", "beta", "gamma")
PATTERNS = (r"^[A-Z][a-z]{2,8}$", r"^[0-9]{3}-[0-9]{4}$", r"^[a-z]{2,6}@[a-z]{2,6}\.com$", r"^v[0-9]\.[0-9]$")


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("enum", "integer", "number", "string", "pattern", "boolean"))
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice((1, 10, 100))}
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(4, 16)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    return {"type": "boolean"}


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        roll = rng.random()
        if depth < 2 and roll < 0.25:
            props[f"obj_{i}"] = _object(rng, depth + 1)
        elif roll < 0.45:
            props[f"list_{i}"] = {"type": "array", "items": _leaf(rng), "minItems": 1, "maxItems": rng.randint(1, 3)}
        else:
            props[f"field_{i}"] = _leaf(rng)
    names = list(props)
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def seeded_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` schemas, the same for the same seed."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(count)]


def schema_chat(schema: dict[str, Any]) -> list[dict[str, str]]:
    """A chat asking for one JSON object following ``schema``."""
    import json

    return [
        {"role": "system", "content": "You answer with one JSON object and nothing else."},
        {"role": "user", "content": f"Produce an example object for this JSON schema:\n{json.dumps(schema)}"},
    ]
