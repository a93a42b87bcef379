"""Scanning JSON text that may still be growing: where a value ends, which keys an object has so far.

Job: the tool-call parsers see a model's output one delta at a time. They need,
for a prefix of the final text, the parts of a JSON object already written (its
complete keys, and for each key the raw text of its value so far), without
parsing anything twice into Python values. Raw text is kept as written: a
value's text in a prefix is always a prefix of that value's text in the final
output, which is what makes streamed argument fragments add up to the collected
arguments.

Pure Python, no imports beyond the standard library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"


def skip_ws(text: str, i: int) -> int:
    """The first index at or after ``i`` that is not JSON whitespace (``len(text)`` when none)."""
    n = len(text)
    while i < n and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``text[i]``; None when the text ends first.

    Strings, objects and arrays end at their closing character (escapes and nested
    strings respected); a number or literal ends at the next delimiter, so one that
    reaches the end of the text is not known to be complete.
    """
    n = len(text)
    c = text[i]
    if c == '"':
        j = i + 1
        while j < n:
            ch = text[j]
            if ch == "\\":
                j += 2
                continue
            if ch == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_string = 0, i, False
        while j < n:
            ch = text[j]
            if in_string:
                if ch == "\\":
                    j += 2
                    continue
                if ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < n and text[j] not in ",}] \t\n\r":
        j += 1
    return j if j < n else None


@dataclass(frozen=True)
class FieldSpan:
    """One key's value in the scanned text: ``text[start:end]``, ``complete`` once it cannot grow."""

    start: int
    end: int
    complete: bool


@dataclass
class ObjectScan:
    """What is known of a JSON object from a prefix of its text.

    ``fields``: the keys seen so far, in order, with their value spans (the last one
    may be incomplete); ``end``: the index after the closing brace, None while open;
    ``error``: the text cannot be the start of a JSON object.
    """

    fields: dict[str, FieldSpan] = field(default_factory=dict)
    end: int | None = None
    error: bool = False


def scan_object(text: str, i: int) -> ObjectScan:
    """Scan the JSON object whose ``{`` is at ``text[i]`` (as far as the text goes)."""
    out = ObjectScan()
    n = len(text)
    if i >= n or text[i] != "{":
        out.error = True
        return out
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        out.end = j + 1
        return out
    while j < n:
        if text[j] != '"':
            out.error = True
            return out
        key_end = value_end(text, j)
        if key_end is None:
            return out
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            out.error = True
            return out
        j = skip_ws(text, key_end)
        if j >= n:
            return out
        if text[j] != ":":
            out.error = True
            return out
        j = skip_ws(text, j + 1)
        if j >= n:
            return out
        end = value_end(text, j)
        if end is None:
            out.fields[key] = FieldSpan(j, n, False)
            return out
        out.fields[key] = FieldSpan(j, end, True)
        j = skip_ws(text, end)
        if j >= n:
            return out
        if text[j] == "}":
            out.end = j + 1
            return out
        if text[j] != ",":
            out.error = True
            return out
        j = skip_ws(text, j + 1)
    return out
