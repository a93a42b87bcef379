"""The request fields that ask for structured output, as OpenAI and vLLM spell them.

OpenAI: ``response_format`` ``{"type": "text" | "json_object" | "json_schema"}`` with
``json_schema: {name, schema, strict, description}``. vLLM: ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``) and
the older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. At most
one of them may ask for a constraint. Pure data (no grammar library): compiling is the
engine host's (``compile.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixserve.replica.structured_output.params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "structural_tag",
    "disable_any_whitespace",
)
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


class StructuredOutputFieldError(ValueError):
    """A structured-output field that is malformed or conflicts with another; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputFields:
    """The structured-output fields of one request body, as sent (None = absent)."""

    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The one constraint these fields ask for, or None; raises StructuredOutputFieldError."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        from_format = _from_response_format(self.response_format)
        if from_format is not None:
            found.append(("response_format", from_format))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", _from_structured_outputs(self.structured_outputs)))
        for field, kind in GUIDED_FIELDS.items():
            value = getattr(self, field)
            if value is not None:
                found.append((field, _build(field, **{kind: value})))
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise StructuredOutputFieldError(
                f"only one structured-output constraint may be sent, got {names}", found[1][0]
            )
        return found[0][1] if found else None


def _build(param: str, **kwargs: Any) -> StructuredOutputsParams:
    """StructuredOutputsParams(**kwargs), its errors naming ``param`` (the field the client sent)."""
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        if param != "structured_outputs":  # a single-kind field: name it, not vLLM's inner field
            message = message.replace(f"structured_outputs.{next(iter(kwargs))}", param)
        raise StructuredOutputFieldError(message, param) from None


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise StructuredOutputFieldError("response_format must be an object with a type", "response_format")
    kind = value.get("type")
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise StructuredOutputFieldError(f"unknown field response_format.{sorted(extra)[0]}", "response_format")
    if kind == "text":
        if "json_schema" in value:
            raise StructuredOutputFieldError("response_format.json_schema needs type json_schema", "response_format")
        return None
    if kind == "json_object":
        if "json_schema" in value:
            raise StructuredOutputFieldError("response_format.json_schema needs type json_schema", "response_format")
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping):
            raise StructuredOutputFieldError(
                "response_format.json_schema must be an object with a schema", "response_format.json_schema"
            )
        extra = set(spec) - JSON_SCHEMA_KEYS
        if extra:
            raise StructuredOutputFieldError(
                f"unknown field response_format.json_schema.{sorted(extra)[0]}", "response_format.json_schema"
            )
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise StructuredOutputFieldError(
                "response_format.json_schema.name must be a string", "response_format.json_schema.name"
            )
        if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
            raise StructuredOutputFieldError(
                "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict"
            )
        schema = spec.get("schema")
        if not isinstance(schema, Mapping):
            raise StructuredOutputFieldError(
                "response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema.schema"
            )
        # Decoding is constrained either way: strict or not, the output follows the schema.
        return _build("response_format.json_schema.schema", json=dict(schema))
    raise StructuredOutputFieldError(
        f"response_format type {kind!r} is not supported; send text, json_object or json_schema", "response_format.type"
    )


def _from_structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, Mapping):
        raise StructuredOutputFieldError("structured_outputs must be an object", "structured_outputs")
    extra = set(value) - set(STRUCTURED_OUTPUTS_KEYS)
    if extra:
        raise StructuredOutputFieldError(
            f"unknown field structured_outputs.{sorted(extra)[0]}; send one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}",
            "structured_outputs",
        )
    # vLLM sends every key, unset ones as null or false.
    kwargs = {k: v for k, v in value.items() if v is not None and not (k == "json_object" and v is False)}
    return _build("structured_outputs", **kwargs)
