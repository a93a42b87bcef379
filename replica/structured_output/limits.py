"""What a constraint may ask of the compiler, checked before it is compiled.

xgrammar expands a counted repeat (``a{1000}``, ``[a-z]{3,1000}``) into that many copies,
and its compile time grows with the square of the count: with 0.2.8 on two cores
``^a{1000}$`` as a JSON-schema ``pattern`` takes about 0.2 s, ``a{2000}`` 0.86 s,
``a{10000}`` 4.6 s and ``a{20000}`` 18 s. A compile cannot be interrupted, so a few ~100-byte
schemas could otherwise hold every compile worker for minutes. ``GrammarLimits.check``
walks the constraint's text (no compiler) and refuses, as a 400 naming the limit:

* a repeat count above ``max_repeat``; repeats nested in a repeated group count as their
  product (``(a{100}){100}`` is 10,000 copies);
* a spec whose repeats' squared counts sum to more than ``max_repeat ** 2``: the whole
  constraint costs at most what one maximal repeat costs, however many patterns it has;
* a spec (the schema's compact JSON, the regex, the grammar) longer than ``max_spec_chars``:
  its walk, hash and compile all grow with it;
* a JSON-schema length or count (``minLength``, ``maxLength``, ``minItems``, ``maxItems``,
  ``minProperties``, ``maxProperties``, ``minContains``, ``maxContains``) above
  ``max_length``. 0.2.8 compiles these without expanding them (``maxLength: 20000`` in
  30 ms), so their bound is looser; it keeps a compiler version that does expand them
  from turning them into the same attack.

Regexes are scanned where they occur: the ``regex`` kind, every ``pattern`` (and
``patternProperties`` key) of a JSON schema or structural tag, and the EBNF of a
``grammar`` (string literals skipped: their braces are text).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prefixserve.replica.errors import RequestRejected
from prefixserve.replica.structured_output.params import MAX_SPEC_CHARS, StructuredOutputsParams

# JSON-schema keywords whose integer value xgrammar may expand into that many copies.
LENGTH_KEYWORDS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
# A repeat count with more digits than this is "huge" (int() of thousands of digits is itself slow).
_MAX_DIGITS = 9
_HUGE = 10**_MAX_DIGITS


class GrammarLimitError(RequestRejected):
    """A constraint that asks the compiler for more than this server allows (HTTP 400)."""


def _count(digits: str) -> int:
    return _HUGE if len(digits) > _MAX_DIGITS else int(digits or "0")


def _repeat_at(text: str, i: int) -> tuple[int, int] | None:
    """The largest count of a ``{n}``, ``{n,}``, ``{n,m}`` or ``{,m}`` quantifier starting at ``text[i]``
    and the index after it; None when the brace there is a literal."""
    end = text.find("}", i + 1)
    if end < 0:
        return None
    body = text[i + 1 : end].replace(" ", "")
    low, comma, high = body.partition(",")
    if not (low.isdigit() or high.isdigit()) or not (low == "" or low.isdigit()) or not (high == "" or high.isdigit()):
        return None
    if not comma and not low:
        return None
    return max(_count(low), _count(high)), end + 1


def repeat_counts(text: str, *, ebnf: bool = False) -> Iterator[int]:
    """The counted repeats of a regex (``ebnf``: of an xgrammar EBNF grammar), each as the number of
    copies it expands to: its count times the counts of the repeated groups around it."""
    # One list of counts per open group; a group's repeat multiplies what it holds.
    groups: list[list[int]] = [[]]
    last_group: list[int] | None = None  # the counts of the group that just closed
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i, last_group = i + 2, None
            continue
        if ch == "[":
            # A character class: braces and parentheses inside are literal.
            j = i + 1
            if j < n and text[j] == "^":
                j += 1
            if j < n and text[j] == "]":
                j += 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, last_group = j + 1, None
            continue
        if ebnf and ch in "\"'":
            j = i + 1
            while j < n and text[j] != ch:
                j += 2 if text[j] == "\\" else 1
            i, last_group = j + 1, None
            continue
        if ebnf and ch == "#":  # a comment, to the end of its line
            j = text.find("\n", i)
            i, last_group = (n if j < 0 else j), None
            continue
        if ch == "(":
            groups.append([])
            i, last_group = i + 1, None
            continue
        if ch == ")" and len(groups) > 1:
            last_group = groups.pop()
            groups[-1].extend(last_group)
            i += 1
            continue
        if ch == "{":
            found = _repeat_at(text, i)
            if found is not None:
                count, i = found
                if last_group:
                    # The group's own counts were added when it closed: replace them by their copies.
                    del groups[-1][len(groups[-1]) - len(last_group) :]
                    groups[-1].extend(min(c * count, _HUGE) for c in last_group)
                else:
                    groups[-1].append(count)
                last_group = None
                continue
        i, last_group = i + 1, None
    # Unclosed groups (the compiler refuses them anyway) still count.
    for group in groups:
        yield from group


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds ``check`` holds a constraint to (``EngineConfig.max_grammar_repeat`` and
    ``max_grammar_length``); the module docstring says why each exists."""

    max_repeat: int = 1000
    max_length: int = 16384
    max_spec_chars: int = MAX_SPEC_CHARS

    def __post_init__(self) -> None:
        if self.max_repeat < 1 or self.max_length < 1 or self.max_spec_chars < 1:
            raise ValueError("grammar limits must be at least 1")

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise GrammarLimitError (400) naming the limit when ``params`` asks for more than it allows."""
        kind = params.kind
        where = f"structured_outputs.{kind}"
        if len(params.spec) > self.max_spec_chars:
            raise GrammarLimitError(
                f"{where} has {len(params.spec)} characters; this server allows at most {self.max_spec_chars} "
                "(max_grammar_spec_chars): shorten it"
            )
        counts: list[int] = []
        if kind == "regex":
            counts.extend(repeat_counts(params.spec))
        elif kind == "grammar":
            counts.extend(repeat_counts(params.spec, ebnf=True))
        elif kind in ("json", "structural_tag"):
            try:
                value = json.loads(params.spec)
            except ValueError:
                return  # not JSON: the compiler refuses it with its own message
            counts.extend(self._walk(value, where))
        self._check_counts(counts, where)

    def _walk(self, value: Any, where: str) -> Iterator[int]:
        """The repeat counts of every regex in a JSON schema (or structural tag), its lengths checked."""
        stack = [value]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
                continue
            if not isinstance(node, dict):
                continue
            for key, item in node.items():
                if key == "pattern" and isinstance(item, str):
                    yield from repeat_counts(item)
                elif key == "grammar" and isinstance(item, str):
                    yield from repeat_counts(item, ebnf=True)
                elif key == "patternProperties" and isinstance(item, dict):
                    for pattern in item:
                        yield from repeat_counts(pattern)
                elif key in LENGTH_KEYWORDS and isinstance(item, int) and not isinstance(item, bool):
                    if item > self.max_length:
                        raise GrammarLimitError(
                            f"{where} asks for {key} {item}; this server allows at most {self.max_length} "
                            f"(max_grammar_length): lower it"
                        )
                if isinstance(item, (dict, list)):
                    stack.append(item)

    def _check_counts(self, counts: list[int], where: str) -> None:
        if not counts:
            return
        largest = max(counts)
        if largest > self.max_repeat:
            raise GrammarLimitError(
                f"{where} asks for a repeat of {largest if largest < _HUGE else 'over ' + str(_HUGE)} copies "
                f"(a {{n}} or {{n,m}} count, nested repeats multiplied); this server allows at most "
                f"{self.max_repeat} (max_grammar_repeat), as compile time grows with its square: use a "
                f"smaller count or * / +"
            )
        budget = self.max_repeat**2
        if sum(c * c for c in counts) > budget:
            raise GrammarLimitError(
                f"{where} asks for {len(counts)} repeats whose squared counts sum to more than "
                f"{budget} (max_grammar_repeat {self.max_repeat} squared: a whole constraint may cost "
                f"what one maximal repeat costs): use smaller counts or * / +"
            )
