"""Prefix-cache audit of a prompt log (``prefixserve audit PROMPTS.jsonl``).

Job: the prefix-cache article's audit without a tracing vendor. Read a JSONL log
of OpenAI chat bodies (``{"messages": [...]}``) or completions (``{"prompt": ...}``),
render each as the model sees it (the tokenizer's chat template when it has one,
else ChatML), tokenize, and report:

* unique prefixes over the first N tokens and the article's theoretical hit
  rate ``1 - unique / total``;
* the block-level cacheable rate: the fraction of the first N tokens (in full
  ``block_size`` blocks) that one replica with an unbounded cache would have
  served from cache, replaying the log in order;
* the most frequent divergence position from the most common prefix, and the
  token there;
* volatile content in system prompts (timestamps, dates, UUIDs, user ids,
  version strings, reordered few-shots), each with the article's fix, and where
  the first occurrence sits in tokens (every block from there on misses).

* how the router would spread the log: distinct routing keys (router/routing_key.py's
  ``static_prefix`` / ``routing_key``, the very functions the router runs) and
  the prompts without a static prefix.

The log is streamed line by line (binary, each line read with a bound), so
memory does not grow with the file: per distinct prefix the audit keeps a count
and its first N token ids, never the prompts (``AuditLimits`` bounds the
distinct things it remembers; past a bound the report says it is approximate).
Time is linear in the log's size: one regex scan per detector and record, the
matches merged in one pass (see DETECTORS for the patterns' shape). Lines that
are too long, not UTF-8, not JSON, nested too deeply, not a chat or completions
body, or holding text that is not Unicode (a lone surrogate) are counted, the
first ones reported by line number, and skipped; the CLI names each on stderr,
prints the report and exits with status 3 (router/cli/'s EXIT_SKIPPED). A
file with no usable record (empty, unreadable, all malformed) raises
``AuditError`` (status 2). A byte progress bar goes to stderr on long files.

Invariants: ``audit`` is pure given the records and a tokenizer (anything with
``encode``); only the CLI loads a model's tokenizer (never its weights).
Imports: stdlib, tqdm, router/routing_key.py, router/cli/; the tokenizer loader from
prefixserve.replica.model.loader lazily (it pulls torch and transformers). No Ray, no HTTP.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from tqdm import tqdm

from prefixserve.replica.contract.routing import content_text
from prefixserve.replica.contract.tokenizer import load_tokenizer
from prefixserve.router.cli.common import EXIT_SKIPPED
from prefixserve.router.routing_key import PREFIX_HASH_HEADER, routing_key, static_prefix

DEFAULT_PREFIX_TOKENS = 512
DEFAULT_BLOCK_SIZE = 16
# A request body longer than this is not a prompt worth auditing (128k tokens is ~0.5 MB).
MAX_LINE_BYTES = 8 * 1024 * 1024
MAX_REPORTED_MALFORMED = 100
# Logs at least this large get a progress bar.
PROGRESS_MIN_BYTES = 16 * 1024 * 1024


class AuditError(Exception):
    """The log cannot be audited at all (missing, unreadable, empty, nothing valid)."""


class Tokenizer(Protocol):
    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...


# ------------------------------------------------------------------ reading


@dataclass(frozen=True)
class PromptRecord:
    """One usable log line: its number, the static prefix, the rendered parts and its routing key."""

    line: int
    system: str  # the static prefix (router/routing_key.py's static_prefix; "" when none)
    messages: tuple[tuple[str, str], ...] | None  # (role, content) for chat records
    prompt: str | None  # completions records
    key: str | None = None  # the routing key the router would use (router/routing_key.py's routing_key)


@dataclass(frozen=True)
class MalformedLine:
    line: int
    reason: str


# JSON's \u escapes can spell a lone UTF-16 surrogate, which no tokenizer or hash can encode.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str, where: str) -> str:
    """``value`` if it is encodable Unicode text, else ValueError naming ``where`` and the offending character."""
    bad = _SURROGATE.search(value)
    if bad is not None:
        raise ValueError(
            f"{where} holds a lone surrogate (\\u{ord(bad.group()):04x} at character {bad.start()}): not Unicode text"
        )
    return value


def parse_record(obj: Any, line: int) -> PromptRecord:
    """A PromptRecord from one decoded JSON line (ValueError says what is wrong)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("cache_salt"), str):
        _text(obj["cache_salt"], "'cache_salt'")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        pairs = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            pairs.append(
                (
                    _text(m["role"], f"messages[{i}].role"),
                    _text(content_text(m.get("content")), f"messages[{i}].content"),
                )
            )
        return PromptRecord(line, static_prefix(messages) or "", tuple(pairs), None, routing_key(obj))
    if "prompt" in obj:
        prompt = obj["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("'prompt' must be a string")
        return PromptRecord(line, "", None, _text(prompt, "'prompt'"), routing_key(obj))
    raise ValueError("no 'messages' or 'prompt' field")


@dataclass
class LogStats:
    """Per-line bookkeeping of one pass over a log: the first malformed lines and how many there were.

    ``on_malformed``, when given, is called with every malformed line as it is
    found (the CLI prints each on stderr), not only the first ``max_reported``.
    """

    max_reported: int = MAX_REPORTED_MALFORMED
    lines: int = 0
    num_malformed: int = 0
    malformed: list[MalformedLine] = field(default_factory=list)
    on_malformed: Callable[[MalformedLine], None] | None = None

    def bad(self, line: int, reason: str) -> None:
        self.num_malformed += 1
        bad = MalformedLine(line, reason)
        if len(self.malformed) < self.max_reported:
            self.malformed.append(bad)
        if self.on_malformed is not None:
            self.on_malformed(bad)


def open_log(path: str | Path) -> BinaryIO:
    """The log opened for binary reading; AuditError says why it cannot be."""
    try:
        return open(path, "rb")  # noqa: SIM115 -- the caller closes it
    except FileNotFoundError:
        raise AuditError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise AuditError(f"{path}: is a directory, expected a JSONL file") from None
    except OSError as exc:
        raise AuditError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def _decode_line(raw: bytes) -> Any:
    """JSON of one line; ValueError with the reason for bad UTF-8, bad JSON or too deep nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 (byte {exc.start + 1} of the line)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        # The decoder recurses per nesting level; a hostile line must not end the audit.
        raise ValueError("invalid JSON: nested too deeply") from None


def iter_log(
    path: str | Path,
    stats: LogStats | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
    progress: bool = False,
) -> Iterator[PromptRecord]:
    """The usable records of a JSONL prompt log, one line at a time.

    Memory is bounded by ``max_line_bytes`` whatever the file's size: a longer
    line is skipped in chunks, never held whole. Lines that are too long, not
    UTF-8, not JSON, nested too deeply or not a chat/completions body are
    counted in ``stats`` (with their numbers, up to its cap) and skipped.
    ``progress`` shows a byte progress bar on stderr.
    """
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    stats = stats if stats is not None else LogStats()
    with open_log(path) as f:
        try:
            size = os.fstat(f.fileno()).st_size
        except OSError:
            size = None
        with tqdm(
            total=size, unit="B", unit_scale=True, desc="audit", file=sys.stderr, disable=not progress, leave=False
        ) as bar:
            number = 0
            while True:
                raw = f.readline(max_line_bytes + 1)
                if not raw:
                    break
                number += 1
                stats.lines = number
                read = len(raw)
                if raw.endswith(b"\n"):
                    raw = raw[:-1]
                elif len(raw) > max_line_bytes:
                    read += _skip_rest_of_line(f)
                    stats.bad(number, f"line longer than {max_line_bytes} bytes (skipped)")
                    bar.update(read)
                    continue
                bar.update(read)
                if not raw.strip():
                    continue
                try:
                    yield parse_record(_decode_line(raw), number)
                except RecursionError:
                    stats.bad(number, "nested too deeply")
                except ValueError as exc:
                    stats.bad(number, str(exc))


def _skip_rest_of_line(f: BinaryIO, chunk: int = 1 << 20) -> int:
    """Read past the end of the current line in bounded chunks; returns the bytes skipped."""
    skipped = 0
    while True:
        part = f.readline(chunk)
        skipped += len(part)
        if not part or part.endswith(b"\n"):
            return skipped


# ---------------------------------------------------------------- rendering


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def render(record: PromptRecord, tokenizer: Tokenizer) -> str:
    """The prompt text the model sees: the tokenizer's chat template, else ChatML."""
    if record.prompt is not None:
        return record.prompt
    messages = [{"role": r, "content": c} for r, c in record.messages or ()]
    template = getattr(tokenizer, "apply_chat_template", None)
    if template is not None and getattr(tokenizer, "chat_template", None):
        try:
            text: str = template(messages, tokenize=False, add_generation_prompt=True)
            return text
        except Exception:  # a template that rejects these roles: fall back, still comparable
            pass
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in record.messages or ()) + "<|im_start|>assistant\n"


# ---------------------------------------------------------------- detectors

_MONTHS = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
_DAYS = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,?"


@dataclass(frozen=True)
class Detector:
    kind: str
    pattern: re.Pattern[str]
    fix: str


# Order matters: a span claimed by an earlier detector is not reported again
# (a timestamp is not also a date; a UUID is not also a user id).
# Every pattern runs in linear time: no unbounded repeat is followed, through
# optional items only, by another unbounded repeat that can take the same
# character (``\s*[:=]?\s*`` backtracks quadratically on a run of spaces), so such
# repeats are possessive (``*+``) or folded into one; nor is one nested in another.
DETECTORS: tuple[Detector, ...] = (
    Detector(
        "uuid",
        re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
        "Session and request ids do not belong in the system prompt: keep it the same for every "
        "request and pass the id as metadata or in the first user message.",
    ),
    Detector(
        "timestamp",
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"
            r"|\b\d{1,2}/\d{1,2}/\d{2,4},? \d{1,2}:\d{2}(?::\d{2})?(?: ?[AaPp][Mm])?"
            r"|\b\d{1,2}:\d{2}:\d{2}\b"
            r"|\b(?:[Tt]imestamp|[Tt]ime|[Nn]ow|[Ee]poch)\s*[:=]\s*\d{9,13}\b"
        ),
        "Take the timestamp out of the system prompt; pass the current time in the user message if the model needs it.",
    ),
    Detector(
        "date",
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}/\d{1,2}/\d{4}\b"
            rf"|\b(?:{_DAYS} )?\d{{1,2}} {_MONTHS} \d{{4}}\b|\b{_MONTHS} \d{{1,2}}(?:st|nd|rd|th)?, \d{{4}}\b"
        ),
        "Take the date out of the system prompt; pass it as part of the user message if it is needed.",
    ),
    Detector(
        "user_id",
        re.compile(
            # "User ID: u-42", "session_id=abc", "customer #1234"; a bare "User:" (few-shot
            # speaker labels) is not an id.
            r"\b(?:user|customer|account|client|session|tenant|member)[ _-]?"
            r"(?:id|name|handle|number|no\.?)\s*+[:=#]?\s*+[\"']?[A-Za-z0-9](?:[\w.@-]*[A-Za-z0-9])?"
            r"|\b(?:user|customer|account|client|session|tenant|member)\s*#\s*\d+",
            re.IGNORECASE,
        ),
        "Separate the static from the contextual: keep the system prompt the same for every user "
        "and add the user's id and preferences as the first message of the history.",
    ),
    Detector(
        "version",
        re.compile(
            r"\[v\d[\w.-]*\]|\bv\d+\.\d++[\w.-]*\b"
            r"|\b(?:version|release|build|rev(?:ision)?)\s*+[:=#]?\s*+v?\d+\.\d++[\w.-]*\b",
            re.IGNORECASE,
        ),
        "Do not version the prompt in its text (it changes with every deploy); version it by name "
        "in your prompt registry instead.",
    ),
)

FEWSHOT_FIX = (
    "Dynamic few-shots: use a fixed set of examples, always in the same order "
    "(FIXED_EXAMPLES = [pool[0], pool[1], pool[2]]), or move per-request examples after the static prefix."
)


@dataclass
class VolatileFinding:
    """One kind of volatile content found in system prompts."""

    kind: str
    fix: str
    records: int  # records whose system prompt contains it
    distinct_values: int  # how many different values (1: constant, harmless for caching)
    example: str
    example_line: int
    first_token_position: int | None  # token offset of the example in its rendered prompt

    @property
    def breaks_cache(self) -> bool:
        return self.distinct_values > 1


def _spans(text: str, detectors: Sequence[Detector] = DETECTORS) -> list[tuple[str, int, int, str]]:
    """(kind, start, end, value) of every volatile match, earlier detectors winning overlaps.

    One regex scan per detector; the spans claimed so far are kept sorted and
    disjoint, and each detector's matches (in order, disjoint) are merged into
    them in one pass, so the work is linear in the text and the matches.
    """
    taken: list[tuple[int, int]] = []
    out = []
    for det in detectors:
        merged: list[tuple[int, int]] = []
        i = 0
        for m in det.pattern.finditer(text):
            s, e = m.span()
            # Claimed spans ending by s overlap neither this match nor any later one.
            while i < len(taken) and taken[i][1] <= s:
                merged.append(taken[i])
                i += 1
            if i < len(taken) and taken[i][0] < e:
                continue  # overlaps an earlier detector's span
            merged.append((s, e))
            out.append((det.kind, s, e, m.group(0)))
        merged.extend(taken[i:])
        taken = merged
    return out


def _normalized_lines(text: str, spans: Sequence[tuple[str, int, int, str]]) -> list[tuple[str, int]]:
    """Non-empty lines of a system prompt with volatile spans masked by their kind, and their offsets.

    A span is masked in the line where it starts. The spans are sorted once and
    walked alongside the lines, each visited once.
    """
    ordered = sorted(spans, key=lambda t: t[1])
    out = []
    pos = 0
    j = 0
    for raw in text.splitlines(keepends=True):
        begin, end = pos, pos + len(raw)
        pos = end
        masked, cursor = [], begin
        while j < len(ordered) and ordered[j][1] < end:
            kind, s, e, _ = ordered[j]
            j += 1
            masked += [text[cursor:s], f"<{kind}>"]
            cursor = max(cursor, min(e, end))
        masked.append(text[cursor:end])
        line = "".join(masked).strip()
        if line:
            out.append((line, begin + len(raw) - len(raw.lstrip())))
    return out


# ---------------------------------------------------------------- the audit


@dataclass
class Divergence:
    position: int  # token index where most prompts leave the most common prefix
    token_id: int | None  # the most common prefix's token there (None: it ended)
    token_text: str | None
    count: int  # prompts diverging at this position
    num_diverging: int  # prompts differing from the most common prefix at all
    context: str  # decoded text just before the position


@dataclass
class AuditReport:
    path: str | None
    prefix_tokens: int
    block_size: int
    num_records: int
    malformed: list[MalformedLine]  # the first ones, up to MAX_REPORTED_MALFORMED
    unique_prefixes: int
    theoretical_hit_rate: float  # 1 - unique / total (the article's formula)
    cacheable_token_rate: float  # block-level, unbounded single cache, in log order
    most_common_prefix_share: float  # fraction of records with the most common prefix
    divergence: Divergence | None
    volatile: list[VolatileFinding]
    reordered_fewshots: VolatileFinding | None
    mean_prompt_tokens: float
    num_with_system: int
    num_malformed: int = 0  # every malformed line, listed or not
    unique_routing_keys: int = 0  # distinct X-Prefix-Hash keys (router/routing_key.py's routing_key)
    num_without_routing_key: int = 0  # records without a static prefix: routed by load
    approximate: bool = False  # a tracking limit was reached: counts beyond it are estimates

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for f, src in zip(d["volatile"], self.volatile):
            f["breaks_cache"] = src.breaks_cache
        if self.reordered_fewshots is not None:
            d["reordered_fewshots"]["breaks_cache"] = self.reordered_fewshots.breaks_cache
        return d

    @property
    def findings(self) -> list[VolatileFinding]:
        out = list(self.volatile)
        if self.reordered_fewshots is not None:
            out.append(self.reordered_fewshots)
        return out


@dataclass(frozen=True)
class AuditLimits:
    """How much the audit remembers; past a limit the figures it feeds become estimates.

    max_prefixes: distinct first-N-token prefixes (and routing keys) counted exactly.
    max_blocks: distinct cached blocks of the replayed cache.
    max_values: distinct values per volatile kind, and orders per few-shot layout.
    max_layouts: distinct system-prompt layouts watched for reordered lines.
    """

    max_prefixes: int = 100_000
    max_blocks: int = 2_000_000
    max_values: int = 10_000
    max_layouts: int = 10_000


def _decode(tokenizer: Any, ids: Sequence[int]) -> str | None:
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return None
    try:
        text: str = decode(list(ids))
    except Exception:
        return None
    return text


def _token_position(rec: PromptRecord, text: str, system_offset: int, tokenizer: Tokenizer) -> int | None:
    """Token index in the rendered prompt of the character ``system_offset`` of the system text."""
    base = text.find(rec.system)  # the system text sits verbatim in the rendered prompt
    if base < 0:
        return None
    return len(_encode(tokenizer, text[: base + system_offset]))


@dataclass
class _Layout:
    """One set of system-prompt lines (volatile values masked), in the orders seen."""

    first_order: tuple[str, ...] | None  # dropped once a second order gave the example
    orders: set[bytes]
    records: int = 0
    example: tuple[str, int, int | None] | None = None  # (text, line, token position)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class Auditor:
    """The audit as a stream: ``add`` one record at a time, ``report`` at the end.

    Memory depends on how many distinct prefixes, blocks, values and layouts
    the log has (each bounded by ``limits``), never on the number of records:
    per prefix it keeps a count and its first N token ids, not the prompts.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        limits: AuditLimits = AuditLimits(),
    ) -> None:
        if prefix_tokens < 1:
            raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.tokenizer = tokenizer
        self.prefix_tokens = prefix_tokens
        self.block_size = block_size
        self.limits = limits
        self.num_records = 0
        self.num_with_system = 0
        self._prompt_tokens = 0
        # first-N-token prefix (token ids as int64 bytes) -> records with it, in first-seen order
        self._prefixes: dict[bytes, int] = {}
        self._untracked_prefixes = 0
        self._blocks: set[bytes] = set()
        self._hit_tokens = 0
        self._prefix_token_total = 0
        self._keys: set[str] = set()
        self._untracked_keys = 0
        self._without_key = 0
        self._first: dict[str, tuple[str, int, int | None]] = {}  # kind -> (value, line, token position)
        self._kind_records: Counter[str] = Counter()
        self._kind_values: dict[str, set[bytes]] = defaultdict(set)
        self._layouts: dict[bytes, _Layout] = {}
        self.approximate = False

    # -- per record --------------------------------------------------------------
    def add(self, record: PromptRecord) -> None:
        """Account one record: render, tokenize, count; nothing of the prompt is kept.

        ValueError, before anything is counted, when the tokenizer refuses the text.
        """
        text = render(record, self.tokenizer)
        try:
            tokens = _encode(self.tokenizer, text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the tokenizer refused it: {exc}") from None
        self.num_records += 1
        self._prompt_tokens += len(tokens)
        prefix = tokens[: self.prefix_tokens]
        self._count_prefix(array("q", prefix).tobytes())
        self._replay_blocks(prefix)
        self._count_key(record.key)
        if record.system:
            self.num_with_system += 1
            self._volatile(record, text)

    def _count_prefix(self, key: bytes) -> None:
        if key in self._prefixes:
            self._prefixes[key] += 1
        elif len(self._prefixes) < self.limits.max_prefixes:
            self._prefixes[key] = 1
        else:
            self._untracked_prefixes += 1  # counted as distinct: an upper bound on unique prefixes
            self.approximate = True

    def _replay_blocks(self, prefix: list[int]) -> None:
        # One unbounded cache replaying the log in order; like the engine, the last
        # prompt token is always computed, never cached. Blocks are chained digests.
        bs = self.block_size
        self._prefix_token_total += len(prefix)
        parent = b""
        matched = True
        for b in range(len(prefix) // bs):
            parent = _digest(parent + array("q", prefix[b * bs : (b + 1) * bs]).tobytes())
            if matched and parent in self._blocks and (b + 1) * bs < len(prefix):
                self._hit_tokens += bs
            else:
                matched = False
            if len(self._blocks) < self.limits.max_blocks:
                self._blocks.add(parent)
            elif parent not in self._blocks:
                self.approximate = True

    def _count_key(self, key: str | None) -> None:
        if key is None:
            self._without_key += 1
        elif key in self._keys or len(self._keys) < self.limits.max_prefixes:
            self._keys.add(key)
        else:
            self._untracked_keys += 1
            self.approximate = True

    def _volatile(self, record: PromptRecord, text: str) -> None:
        spans = _spans(record.system)
        per_kind: dict[str, list[str]] = defaultdict(list)
        for kind, s, _e, value in sorted(spans, key=lambda t: t[1]):
            if kind not in per_kind and kind not in self._first:
                self._first[kind] = (value, record.line, _token_position(record, text, s, self.tokenizer))
            per_kind[kind].append(value)
        for kind, vals in per_kind.items():
            self._kind_records[kind] += 1
            seen = self._kind_values[kind]
            if len(seen) < self.limits.max_values:
                seen.add(_digest("\x00".join(vals).encode()))
        lines = _normalized_lines(record.system, spans)
        if len(lines) > 1:
            self._layout(record, text, lines)

    def _layout(self, record: PromptRecord, text: str, lines: list[tuple[str, int]]) -> None:
        ordered = tuple(line for line, _ in lines)
        layout_key = _digest("\x00".join(sorted(ordered)).encode())
        order_key = _digest("\x00".join(ordered).encode())
        layout = self._layouts.get(layout_key)
        if layout is None:
            if len(self._layouts) >= self.limits.max_layouts:
                self.approximate = True
                return
            layout = self._layouts[layout_key] = _Layout(first_order=ordered, orders={order_key})
        layout.records += 1
        if order_key in layout.orders or len(layout.orders) >= self.limits.max_values:
            return
        layout.orders.add(order_key)
        if layout.example is None and layout.first_order is not None:
            # The example is the line that moved, in this record (the first with a second order).
            moved = next(k for k, (x, y) in enumerate(zip(layout.first_order, ordered)) if x != y)
            layout.example = (
                f"line {moved + 1} of the system prompt: {ordered[moved][:80]!r}",
                record.line,
                _token_position(record, text, lines[moved][1], self.tokenizer),
            )
            layout.first_order = None

    # -- the report ----------------------------------------------------------------
    def report(
        self, malformed: Sequence[MalformedLine] = (), num_malformed: int | None = None, path: str | None = None
    ) -> AuditReport:
        if not self.num_records:
            raise AuditError("no records to audit")
        n = self.num_records
        unique = len(self._prefixes) + self._untracked_prefixes
        divergence, share = self._divergence()
        volatile, reordered = self._findings()
        return AuditReport(
            path=path,
            prefix_tokens=self.prefix_tokens,
            block_size=self.block_size,
            num_records=n,
            malformed=list(malformed),
            unique_prefixes=unique,
            theoretical_hit_rate=1 - unique / n,
            cacheable_token_rate=self._hit_tokens / self._prefix_token_total if self._prefix_token_total else 0.0,
            most_common_prefix_share=share,
            divergence=divergence,
            volatile=volatile,
            reordered_fewshots=reordered,
            mean_prompt_tokens=self._prompt_tokens / n,
            num_with_system=self.num_with_system,
            num_malformed=len(malformed) if num_malformed is None else num_malformed,
            unique_routing_keys=len(self._keys) + self._untracked_keys,
            num_without_routing_key=self._without_key,
            approximate=self.approximate,
        )

    def _divergence(self) -> tuple[Divergence | None, float]:
        # max() keeps the first of equal counts: the prefix seen first, as in log order.
        common_key, common_count = max(self._prefixes.items(), key=lambda kv: kv[1])
        common = array("q", common_key).tolist()
        positions: Counter[int] = Counter()
        for key, count in self._prefixes.items():
            if key == common_key:
                continue
            p = array("q", key).tolist()
            pos = next((i for i, (a, b) in enumerate(zip(common, p)) if a != b), min(len(common), len(p)))
            positions[pos] += count
        share = common_count / self.num_records
        if not positions:
            return None, share
        pos, count = positions.most_common(1)[0]
        token = common[pos] if pos < len(common) else None
        text = _decode(self.tokenizer, [token]) if token is not None else None
        context = _decode(self.tokenizer, common[max(0, pos - 12) : pos]) or ""
        return Divergence(pos, token, text, count, sum(positions.values()), context), share

    def _findings(self) -> tuple[list[VolatileFinding], VolatileFinding | None]:
        findings = []
        for det in DETECTORS:
            if det.kind not in self._first:
                continue
            value, line, position = self._first[det.kind]
            findings.append(
                VolatileFinding(
                    det.kind,
                    det.fix,
                    self._kind_records[det.kind],
                    len(self._kind_values[det.kind]),
                    value,
                    line,
                    position,
                )
            )
        groups = [g for g in self._layouts.values() if len(g.orders) > 1 and g.example is not None]
        if not groups:
            return findings, None
        biggest = max(groups, key=lambda g: len(g.orders))
        assert biggest.example is not None
        example, line, position = biggest.example
        reordered = VolatileFinding(
            "reordered_fewshots",
            FEWSHOT_FIX,
            sum(g.records for g in groups),
            sum(len(g.orders) for g in groups),
            example,
            line,
            position,
        )
        return findings, reordered


def audit(
    records: Iterable[PromptRecord],
    tokenizer: Tokenizer,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    malformed: Sequence[MalformedLine] = (),
    path: str | None = None,
    limits: AuditLimits = AuditLimits(),
) -> AuditReport:
    """Audit records with ``tokenizer`` (anything with ``encode``; ``decode`` and a chat template optional)."""
    auditor = Auditor(tokenizer, prefix_tokens, block_size, limits)
    for record in records:
        auditor.add(record)
    return auditor.report(malformed, path=path)


def audit_file(
    path: str | Path,
    tokenizer: Tokenizer,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    max_line_bytes: int = MAX_LINE_BYTES,
    progress: bool = False,
    limits: AuditLimits = AuditLimits(),
    on_malformed: Callable[[MalformedLine], None] | None = None,
) -> AuditReport:
    """Stream a JSONL log through the audit; AuditError when nothing in it is usable.

    A line that cannot be audited (see ``iter_log``; or its text refused by the
    tokenizer) is skipped and counted; ``on_malformed`` sees each one as it is found.
    """
    auditor = Auditor(tokenizer, prefix_tokens, block_size, limits)
    stats = LogStats(on_malformed=on_malformed)
    for record in iter_log(path, stats, max_line_bytes, progress):
        try:
            auditor.add(record)
        except ValueError as exc:
            stats.bad(record.line, str(exc))
    if not auditor.num_records:
        if not stats.num_malformed:
            raise AuditError(f"{path}: the file is empty; expected one JSON request body per line")
        first = stats.malformed[0]
        raise AuditError(
            f"{path}: none of its {stats.num_malformed} non-empty lines is a chat or completions "
            f"body (line {first.line}: {first.reason})"
        )
    return auditor.report(stats.malformed, stats.num_malformed, str(path))


def format_report(report: AuditReport) -> str:
    """The human-readable report."""
    n = report.num_records
    lines = [
        f"Prefix-cache audit of {report.path or 'the log'}: {n} prompts"
        f" ({report.num_with_system} with a system prompt), mean {report.mean_prompt_tokens:.0f} tokens"
    ]
    for bad in report.malformed:
        lines.append(f"  skipped line {bad.line}: {bad.reason}")
    if report.num_malformed > len(report.malformed):
        lines.append(f"  ... and {report.num_malformed - len(report.malformed)} more malformed lines skipped")
    if report.approximate:
        lines.append("  (a tracking limit was reached: unique counts and rates past it are estimates)")
    lines += [
        "",
        f"Unique prefixes (first {report.prefix_tokens} tokens): {report.unique_prefixes}/{n} "
        f"({report.unique_prefixes / n:.1%})",
        f"Theoretical hit rate if they were all equal: {report.theoretical_hit_rate:.1%}",
        f"Cacheable tokens (full {report.block_size}-token blocks, one unbounded cache, in log order): "
        f"{report.cacheable_token_rate:.1%}",
        f"Most common prefix shared by {report.most_common_prefix_share:.1%} of prompts",
        f"Routing keys ({PREFIX_HASH_HEADER}): {report.unique_routing_keys} distinct; "
        f"{report.num_without_routing_key} prompt(s) without a static prefix (routed by load)",
    ]
    d = report.divergence
    if d is not None:
        where = (
            repr(d.token_text)
            if d.token_text is not None
            else (f"token id {d.token_id}" if d.token_id is not None else "the end of the shorter prompt")
        )
        lines += [
            "",
            f"Most frequent divergence at position {d.position}: {where} "
            f"({d.count} of {d.num_diverging} diverging prompts)",
            "-> the token at that position varies between requests",
        ]
        if d.context:
            lines.append(f"   text just before it: {d.context[-60:]!r}")
    findings = report.findings
    lines.append("")
    if not findings:
        lines.append("No volatile content found in system prompts.")
    for f in findings:
        state = (
            f"varies ({f.distinct_values} distinct values): breaks the cache"
            if f.breaks_cache
            else "constant across the log: harmless until it changes"
        )
        at = f", first at token {f.first_token_position}" if f.first_token_position is not None else ""
        lines += [
            f"[{f.kind}] in {f.records} system prompt(s), {state}{at}",
            f"   e.g. line {f.example_line}: {f.example}",
            f"   fix: {f.fix}",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", help="JSONL log: one chat body ({'messages': ...}) or {'prompt': ...} per line")
    parser.add_argument(
        "--model", default="smollm2", help="tokenizer source: smollm2, a checkpoint dir or a .gguf file"
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=DEFAULT_PREFIX_TOKENS,
        help="compare prompts over their first N tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="KV block size for the cacheable-token rate (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--max-line-bytes",
        type=int,
        default=MAX_LINE_BYTES,
        help="longer lines are reported and skipped unread (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Audit the log and print the report.

    Each skipped line is one line on stderr (``PATH:LINE: reason``). Exit status:
    0, every line audited; EXIT_SKIPPED (router/cli/), the report was printed
    but some lines were skipped; 2, nothing could be audited (one error line).
    """

    def skipped(bad: MalformedLine) -> None:
        print(f"prefixserve audit: {args.prompts}:{bad.line}: {bad.reason} (skipped)", file=sys.stderr)

    try:
        open_log(args.prompts).close()  # a missing file fails before the tokenizer loads
        size = Path(args.prompts).stat().st_size
        tokenizer = load_tokenizer(args.model)
        report = audit_file(
            args.prompts,
            tokenizer,
            args.prefix_tokens,
            args.block_size,
            max_line_bytes=args.max_line_bytes,
            progress=size >= PROGRESS_MIN_BYTES,
            on_malformed=skipped,
        )
    except (ValueError, AuditError, OSError) as exc:
        print(f"prefixserve audit: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2, ensure_ascii=False) if args.json else format_report(report))
    return EXIT_SKIPPED if report.num_malformed else 0
