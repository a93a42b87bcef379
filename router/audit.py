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

Malformed lines are reported by line number and skipped; a file with no usable
record (empty, unreadable, all malformed) raises ``AuditError``.

Invariants: ``audit`` is pure given the records and a tokenizer (anything with
``encode``); only the CLI loads a model's tokenizer (never its weights).
Imports: stdlib; the tokenizer loader from prefixserve.replica.model.loader lazily (it pulls
torch and transformers). No Ray, no HTTP.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

DEFAULT_PREFIX_TOKENS = 512
DEFAULT_BLOCK_SIZE = 16


class AuditError(Exception):
    """The log cannot be audited at all (missing, unreadable, empty, nothing valid)."""


class Tokenizer(Protocol):
    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...


# ------------------------------------------------------------------ reading


@dataclass(frozen=True)
class PromptRecord:
    """One usable log line: its number, the static prefix text and the rendered prompt."""

    line: int
    system: str  # leading system/developer text ("" when none)
    messages: tuple[tuple[str, str], ...] | None  # (role, content) for chat records
    prompt: str | None  # completions records


@dataclass(frozen=True)
class MalformedLine:
    line: int
    reason: str


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    raise ValueError(f"message content must be a string or a list of parts, not {type(content).__name__}")


def parse_record(obj: Any, line: int) -> PromptRecord:
    """A PromptRecord from one decoded JSON line (ValueError says what is wrong)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        pairs = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            pairs.append((m["role"], _content_text(m.get("content"))))
        system = []
        for role, text in pairs:
            if role not in ("system", "developer"):
                break
            system.append(text)
        return PromptRecord(line, "\n".join(system), tuple(pairs), None)
    if "prompt" in obj:
        prompt = obj["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("'prompt' must be a string")
        return PromptRecord(line, "", None, prompt)
    raise ValueError("no 'messages' or 'prompt' field")


def read_log(path: str | Path) -> tuple[list[PromptRecord], list[MalformedLine]]:
    """Parse a JSONL prompt log; raises AuditError when nothing in it is usable."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AuditError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise AuditError(f"{path}: is a directory, expected a JSONL file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AuditError(f"{path}: cannot read it ({exc})") from None
    records: list[PromptRecord] = []
    bad: list[MalformedLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            records.append(parse_record(json.loads(raw), number))
        except json.JSONDecodeError as exc:
            bad.append(MalformedLine(number, f"invalid JSON: {exc.msg} (column {exc.colno})"))
        except ValueError as exc:
            bad.append(MalformedLine(number, str(exc)))
    if not records:
        if not bad:
            raise AuditError(f"{path}: the file is empty; expected one JSON request body per line")
        raise AuditError(f"{path}: none of its {len(bad)} non-empty lines is a chat or completions body "
                         f"(line {bad[0].line}: {bad[0].reason})")
    return records, bad


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
            return template(messages, tokenize=False, add_generation_prompt=True)
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
        "Take the timestamp out of the system prompt; pass the current time in the user message "
        "if the model needs it.",
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
            r"(?:id|name|handle|number|no\.?)\s*[:=#]?\s*[\"']?[A-Za-z0-9](?:[\w.@-]*[A-Za-z0-9])?"
            r"|\b(?:user|customer|account|client|session|tenant|member)\s*#\s*\d+",
            re.IGNORECASE,
        ),
        "Separate the static from the contextual: keep the system prompt the same for every user "
        "and add the user's id and preferences as the first message of the history.",
    ),
    Detector(
        "version",
        re.compile(
            r"\[v\d+(?:\.\d+)*[\w.-]*\]|\bv\d+\.\d+(?:\.\d+)*[\w.-]*\b"
            r"|\b(?:version|release|build|rev(?:ision)?)\s*[:=#]?\s*v?\d+(?:\.\d+)+[\w.-]*\b",
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


def _spans(text: str) -> list[tuple[str, int, int, str]]:
    """(kind, start, end, value) of every volatile match, earlier detectors winning overlaps."""
    taken: list[tuple[int, int]] = []
    out = []
    for det in DETECTORS:
        for m in det.pattern.finditer(text):
            s, e = m.span()
            if any(s < te and ts < e for ts, te in taken):
                continue
            taken.append((s, e))
            out.append((det.kind, s, e, m.group(0)))
    return out


def _normalized_lines(text: str, spans: Sequence[tuple[str, int, int, str]]) -> list[tuple[str, int]]:
    """Non-empty lines of a system prompt with volatile spans masked by their kind, and their offsets."""
    out = []
    pos = 0
    for raw in text.splitlines(keepends=True):
        begin, end = pos, pos + len(raw)
        pos = end
        masked, cursor = [], begin
        for kind, s, e, _ in sorted(spans, key=lambda t: t[1]):
            if begin <= s < end:
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
    malformed: list[MalformedLine]
    unique_prefixes: int
    theoretical_hit_rate: float  # 1 - unique / total (the article's formula)
    cacheable_token_rate: float  # block-level, unbounded single cache, in log order
    most_common_prefix_share: float  # fraction of records with the most common prefix
    divergence: Divergence | None
    volatile: list[VolatileFinding]
    reordered_fewshots: VolatileFinding | None
    mean_prompt_tokens: float
    num_with_system: int

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


def _decode(tokenizer: Any, ids: Sequence[int]) -> str | None:
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return None
    try:
        return decode(list(ids))
    except Exception:
        return None


def _divergence(prefixes: Sequence[tuple[int, ...]], tokenizer: Any) -> tuple[Divergence | None, float]:
    counts = Counter(prefixes)
    common, common_count = counts.most_common(1)[0]
    positions: Counter[int] = Counter()
    for p in prefixes:
        if p == common:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(common, p)) if a != b), min(len(common), len(p)))
        positions[pos] += 1
    share = common_count / len(prefixes)
    if not positions:
        return None, share
    pos, count = positions.most_common(1)[0]
    token = common[pos] if pos < len(common) else None
    text = _decode(tokenizer, [token]) if token is not None else None
    context = _decode(tokenizer, common[max(0, pos - 12) : pos]) or ""
    return Divergence(pos, token, text, count, sum(positions.values()), context), share


def _cacheable_rate(prefixes: Sequence[tuple[int, ...]], block_size: int) -> float:
    """Full blocks of the first N tokens served from an unbounded cache, replaying in order.

    Like the engine, the last prompt token is always computed, never cached.
    """
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for p in prefixes:
        total += len(p)
        n_blocks = len(p) // block_size
        matched = True
        for b in range(n_blocks):
            key = p[: (b + 1) * block_size]
            if matched and key in seen and (b + 1) * block_size < len(p):
                hit += block_size
            else:
                matched = False
            seen.add(key)
    return hit / total if total else 0.0


def _volatile(records: Sequence[PromptRecord], rendered: Sequence[str], tokenizer: Tokenizer) -> tuple[
    list[VolatileFinding], VolatileFinding | None
]:
    # kind -> (index of the first record with it, char offset, value), records with it, value tuples
    first: dict[str, tuple[int, int, str]] = {}
    count: Counter[str] = Counter()
    values: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    # sorted masked lines -> {masked lines in order: (record index, line offsets)}
    layouts: dict[tuple[str, ...], dict[tuple[str, ...], tuple[int, list[int]]]] = defaultdict(dict)
    layout_of: list[tuple[str, ...]] = []
    for i, rec in enumerate(records):
        if not rec.system:
            continue
        spans = _spans(rec.system)
        per_kind: dict[str, list[str]] = defaultdict(list)
        for kind, s, _e, value in sorted(spans, key=lambda t: t[1]):
            if kind not in per_kind:
                first.setdefault(kind, (i, s, value))
            per_kind[kind].append(value)
        for kind, vals in per_kind.items():
            count[kind] += 1
            values[kind].add(tuple(vals))
        lines = _normalized_lines(rec.system, spans)
        if len(lines) > 1:
            ordered = tuple(line for line, _ in lines)
            layout_of.append(tuple(sorted(ordered)))
            layouts[tuple(sorted(ordered))].setdefault(ordered, (i, [off for _, off in lines]))
    findings = []
    for det in DETECTORS:
        if det.kind not in first:
            continue
        i, offset, value = first[det.kind]
        findings.append(VolatileFinding(det.kind, det.fix, count[det.kind], len(values[det.kind]), value,
                                        records[i].line, _token_position(records[i], rendered[i], offset, tokenizer)))
    # Reordered few-shots: the same lines (volatile values masked) in different orders.
    groups = [orders for orders in layouts.values() if len(orders) > 1]
    if not groups:
        return findings, None
    orders = max(groups, key=len)
    (a, (i, offsets)), (b, _) = list(orders.items())[:2]
    moved = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
    reordered_keys = {k for k, o in layouts.items() if len(o) > 1}
    num_records = sum(1 for k in layout_of if k in reordered_keys)
    reordered = VolatileFinding(
        "reordered_fewshots", FEWSHOT_FIX, num_records, sum(len(g) for g in groups),
        f"line {moved + 1} of the system prompt: {a[moved][:80]!r}", records[i].line,
        _token_position(records[i], rendered[i], offsets[moved], tokenizer),
    )
    return findings, reordered


def _token_position(rec: PromptRecord, text: str, system_offset: int, tokenizer: Tokenizer) -> int | None:
    """Token index in the rendered prompt of the character ``system_offset`` of the system text."""
    base = text.find(rec.system)  # the system text sits verbatim in the rendered prompt
    if base < 0:
        return None
    return len(_encode(tokenizer, text[: base + system_offset]))


def audit(
    records: Sequence[PromptRecord],
    tokenizer: Tokenizer,
    prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    malformed: Sequence[MalformedLine] = (),
    path: str | None = None,
) -> AuditReport:
    """Audit parsed records with ``tokenizer`` (anything with ``encode``; ``decode`` and a chat template optional)."""
    if prefix_tokens < 1:
        raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not records:
        raise AuditError("no records to audit")
    rendered = [render(r, tokenizer) for r in records]
    token_lists = [_encode(tokenizer, text) for text in rendered]
    prefixes = [tuple(t[:prefix_tokens]) for t in token_lists]
    unique = len(set(prefixes))
    divergence, share = _divergence(prefixes, tokenizer)
    volatile, reordered = _volatile(records, rendered, tokenizer)
    return AuditReport(
        path=path,
        prefix_tokens=prefix_tokens,
        block_size=block_size,
        num_records=len(records),
        malformed=list(malformed),
        unique_prefixes=unique,
        theoretical_hit_rate=1 - unique / len(records),
        cacheable_token_rate=_cacheable_rate(prefixes, block_size),
        most_common_prefix_share=share,
        divergence=divergence,
        volatile=volatile,
        reordered_fewshots=reordered,
        mean_prompt_tokens=sum(map(len, token_lists)) / len(token_lists),
        num_with_system=sum(1 for r in records if r.system),
    )


def audit_file(path: str | Path, tokenizer: Tokenizer, **kwargs: Any) -> AuditReport:
    records, bad = read_log(path)
    return audit(records, tokenizer, malformed=bad, path=str(path), **kwargs)


def format_report(report: AuditReport) -> str:
    """The human-readable report."""
    n = report.num_records
    lines = [f"Prefix-cache audit of {report.path or 'the log'}: {n} prompts"
             f" ({report.num_with_system} with a system prompt), mean {report.mean_prompt_tokens:.0f} tokens"]
    for bad in report.malformed:
        lines.append(f"  skipped line {bad.line}: {bad.reason}")
    lines += [
        "",
        f"Unique prefixes (first {report.prefix_tokens} tokens): {report.unique_prefixes}/{n} "
        f"({report.unique_prefixes / n:.1%})",
        f"Theoretical hit rate if they were all equal: {report.theoretical_hit_rate:.1%}",
        f"Cacheable tokens (full {report.block_size}-token blocks, one unbounded cache, in log order): "
        f"{report.cacheable_token_rate:.1%}",
        f"Most common prefix shared by {report.most_common_prefix_share:.1%} of prompts",
    ]
    d = report.divergence
    if d is not None:
        where = repr(d.token_text) if d.token_text is not None else (
            f"token id {d.token_id}" if d.token_id is not None else "the end of the shorter prompt")
        lines += ["", f"Most frequent divergence at position {d.position}: {where} "
                      f"({d.count} of {d.num_diverging} diverging prompts)",
                  "-> the token at that position varies between requests"]
        if d.context:
            lines.append(f"   text just before it: {d.context[-60:]!r}")
    findings = report.findings
    lines.append("")
    if not findings:
        lines.append("No volatile content found in system prompts.")
    for f in findings:
        state = (f"varies ({f.distinct_values} distinct values): breaks the cache" if f.breaks_cache
                 else "constant across the log: harmless until it changes")
        at = f", first at token {f.first_token_position}" if f.first_token_position is not None else ""
        lines += [f"[{f.kind}] in {f.records} system prompt(s), {state}{at}",
                  f"   e.g. line {f.example_line}: {f.example}",
                  f"   fix: {f.fix}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------- CLI


@functools.lru_cache(maxsize=4)
def load_tokenizer(model: str) -> Any:
    """The tokenizer (only) of ``model``: ``smollm2``, a checkpoint directory or a .gguf file (cached)."""
    from prefixserve.replica.model.loader import load_tokenizer as _load, resolve

    return _load(resolve(model))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", help="JSONL log: one chat body ({'messages': ...}) or {'prompt': ...} per line")
    parser.add_argument("--model", default="smollm2", help="tokenizer source: smollm2, a checkpoint dir or a .gguf file")
    parser.add_argument("--prefix-tokens", type=int, default=DEFAULT_PREFIX_TOKENS,
                        help="compare prompts over their first N tokens (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="KV block size for the cacheable-token rate (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        records, bad = read_log(args.prompts)
    except AuditError as exc:
        print(f"prefixserve audit: error: {exc}", file=sys.stderr)
        return 2
    try:
        tokenizer = load_tokenizer(args.model)
        report = audit(records, tokenizer, args.prefix_tokens, args.block_size, bad, str(args.prompts))
    except (ValueError, AuditError, OSError) as exc:
        print(f"prefixserve audit: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(), indent=2, ensure_ascii=False) if args.json else format_report(report))
    return 0
